"""Ports handed to a child that binds them later come from outside the ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from trainguard import ports


class _Script(random.Random):
    """A random source that answers ``randrange`` from a script, then falls back."""

    def __init__(self, *answers: int) -> None:
        super().__init__(0)
        self._answers = list(answers)

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:  # type: ignore[override]
        if self._answers:
            return self._answers.pop(0)
        assert stop is not None
        return super().randrange(start, stop, step)


def _range_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", path)


def test_port_is_below_the_ephemeral_range_and_bindable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _range_file(tmp_path, monkeypatch, "32768\t60999\n")
    for _ in range(20):
        port = ports.free_port()
        assert 10000 <= port < 32768
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_avoided_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _range_file(tmp_path, monkeypatch, "32768 60999")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The kernel gave ``taken`` from the real ephemeral range; pretend ours starts above it.
        _range_file(tmp_path, monkeypatch, f"{taken + 100} 60999")
        rng = _Script(taken, taken + 1, taken + 2)
        got = ports.free_ports(1, avoid={taken + 1}, rng=rng)
        assert got not in (taken, taken + 1)


def test_consecutive_ports_are_all_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _range_file(tmp_path, monkeypatch, "32768 60999")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        _range_file(tmp_path, monkeypatch, f"{taken + 100} 60999")
        # The first candidate run covers the held port: it must be passed over.
        base = ports.free_ports(3, rng=_Script(taken - 1))
    assert not base <= taken < base + 3
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("text", ["1024 65535", "garbage", ""])
def test_odd_ranges_fall_back_or_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    _range_file(tmp_path, monkeypatch, text)
    port = ports.free_port(avoid={1})
    assert port != 1
    if text.startswith("1024"):
        # No room below a range that starts at 1024: the kernel's choice, from its range.
        assert port >= 1024
    else:
        assert 10000 <= port < 32768  # unreadable: Linux's default range assumed


def test_no_room_for_a_run_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _range_file(tmp_path, monkeypatch, "10002 60999")
    with pytest.raises(RuntimeError, match="no 5 consecutive free ports"):
        ports.free_ports(5)
    with pytest.raises(ValueError, match="at least 1"):
        ports.free_ports(0)


def test_a_local_jobs_rendezvous_port_is_outside_the_ephemeral_range() -> None:
    """The local actuator's MASTER_PORT: CI once saw rank 0 fail with EADDRINUSE on it."""
    from controller.actuators.local_launch import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    previous = free_port(None)
    for _ in range(10):
        port = free_port(previous)
        assert port != previous
        assert port < low


def test_a_port_just_handed_out_is_not_handed_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs launched back to back: the first's rank 0 has not bound its port yet, so
    the port is free to a bind check, and only this process's memory keeps it apart."""
    _range_file(tmp_path, monkeypatch, "32768 60999")
    monkeypatch.setattr(ports, "_HANDED", {})
    first = ports.free_ports(1, rng=_Script(20000))
    second = ports.free_ports(1, rng=_Script(20000))
    assert second != first
    run = ports.free_ports(3, rng=_Script(second - 1, 25000))
    assert not run <= second < run + 3
