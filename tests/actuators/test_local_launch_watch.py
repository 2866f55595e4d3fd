"""The local actuator relaunches a generation whose ranks never met, against real processes.

Rank 0 of the tiny rank below fails its first ``FAILS`` starts the way rank 0 fails when its
``MASTER_PORT`` was taken (one line, exit 1); the other ranks wait, as they would in the
rendezvous. No torch: the watch judges processes and rank events, not what the ranks run.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import Placement
from controller.actuators.local import LocalJobSpec, LocalProcessActuator
from controller.actuators.local_watch import describe_exit, last_line
from trainguard.wire import RankEvent

pytestmark = pytest.mark.slow

RANK = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if os.environ["RANK"] == "0":
    tries = os.path.join(os.environ["OUT"], "tries")
    n = len(open(tries).read()) if os.path.exists(tries) else 0
    with open(tries, "a") as f:
        f.write("x")
    if n < int(os.environ["FAILS"]):
        print("torch.distributed.DistNetworkError: port", os.environ["MASTER_PORT"],
              "EADDRINUSE: address already in use", flush=True)
        sys.exit(1)
    if os.environ.get("CRASH_LATER"):
        time.sleep(float(os.environ["CRASH_LATER"]))
        sys.exit(3)
time.sleep(60)
"""


def _actuator(tmp_path: Path, fails: int, **kw: Any) -> tuple[LocalProcessActuator, Path]:
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "FAILS": str(fails), **kw.pop("env", {})}
    spec = LocalJobSpec(
        name="gpt",
        argv=[sys.executable, "-c", RANK],
        pool=["node-a"],
        ranks_per_node=2,
        env=env,
        log_dir=tmp_path / "logs",
    )
    placement = Placement(job="gpt", nodes=("node-a",), ranks_per_node=2, tp=1, generation=3)
    options: dict[str, Any] = {"launch_grace_s": 0.2, "watch_interval_s": 0.05, "grace_s": 2.0}
    act = LocalProcessActuator(jobs=[(spec, placement)], **(options | kw))
    return act, out


def _said(act: LocalProcessActuator) -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in act.events if e["reason"].startswith("Launch")]


async def _until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_rank_that_fails_before_the_ranks_met_gets_its_generation_relaunched(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        act, out = _actuator(tmp_path, fails=1)
        try:
            await act.start()
            first_port = act._gens["gpt"].port
            await _until(lambda: _said(act))
            ((reason, message),) = _said(act)
            assert reason == "LaunchRetried"
            assert message.startswith(
                "generation 3: rank 0 exited with exit code 1 before the ranks met "
                f"(torch.distributed.DistNetworkError: port {first_port} EADDRINUSE"
            )
            gen = act._gens["gpt"]
            assert gen.port != first_port and f"relaunched on port {gen.port}" in message
            assert "(retry 1 of 2)" in message
            assert gen.placement.generation == 3 and gen.relaunches == 1
            status = act.status("gpt")
            assert status is not None and not status.finished  # the job runs again
            await asyncio.sleep(0.5)
            assert len(_said(act)) == 1 and (out / "tries").read_text() == "xx"
        finally:
            await act.close()

    asyncio.run(scenario())


def test_relaunches_are_bounded_and_giving_up_is_said_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        act, out = _actuator(tmp_path, fails=99, launch_retries=2)
        try:
            await act.start()
            await _until(lambda: any(r == "LaunchFailed" for r, _ in _said(act)))
            await asyncio.sleep(0.6)  # a dozen more watch rounds
            reasons = [r for r, _ in _said(act)]
            assert reasons == ["LaunchRetried", "LaunchRetried", "LaunchFailed"]
            assert "not relaunched again after 2 relaunch(es)" in _said(act)[-1][1]
            assert (out / "tries").read_text() == "xxx"
        finally:
            await act.close()

    asyncio.run(scenario())


def test_once_a_rank_said_started_an_exit_is_the_jobs_not_the_launchs(tmp_path: Path) -> None:
    async def scenario() -> None:
        act, _ = _actuator(tmp_path, fails=0, env={"CRASH_LATER": "0.5"})
        try:
            await act.start()
            started = RankEvent(job="gpt", rank=1, kind="started", time_unix_s=time.time())
            stale = RankEvent(job="other", rank=0, kind="started", time_unix_s=time.time())
            act.observe_ranks("node-a", [stale, started])
            await _until(lambda: (s := act.status("gpt")) is not None and s.ranks[0].exit_code == 3)
            await asyncio.sleep(0.6)
            assert _said(act) == []  # the detectors' crash, not a relaunch
        finally:
            await act.close()

    asyncio.run(scenario())


def test_a_started_event_older_than_the_launch_does_not_count(tmp_path: Path) -> None:
    async def scenario() -> None:
        act, _ = _actuator(tmp_path, fails=1)
        try:
            await act.start()
            old = RankEvent(job="gpt", rank=0, kind="started", time_unix_s=time.time() - 60)
            act.observe_ranks("node-a", [old])  # the previous generation's, reported late
            await _until(lambda: _said(act))
            assert _said(act)[0][0] == "LaunchRetried"
        finally:
            await act.close()

    asyncio.run(scenario())


def test_an_exit_past_the_launch_window_is_left_to_the_detectors(tmp_path: Path) -> None:
    async def scenario() -> None:
        act, _ = _actuator(tmp_path, fails=0, env={"CRASH_LATER": "0.3"}, launch_window_s=0.1)
        try:
            await act.start()
            await _until(lambda: (s := act.status("gpt")) is not None and s.ranks[0].exit_code == 3)
            await asyncio.sleep(0.6)
            assert _said(act) == []
        finally:
            await act.close()

    asyncio.run(scenario())


def test_exit_descriptions_and_log_tails(tmp_path: Path) -> None:
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-200) == "signal 200"
    log = tmp_path / "rank0.log"
    assert last_line(log) == ""  # no log at all
    log.write_bytes(b"")
    assert last_line(log) == ""
    log.write_bytes(b"first\n" + b"x" * 10_000 + b"\nboom \x1b[31m\xff\xfe\n\n  \n")
    assert last_line(log) == "boom  [31m\ufffd\ufffd"  # bytes that are no text: replaced
    log.write_bytes(b"y" * 1000 + b"\n")
    assert last_line(log, limit=50) == "y" * 50
