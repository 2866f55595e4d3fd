"""Edge cases the node agent's acceptance probe found: settings that could not be parsed or
were not finite, a NIC error window fed a wall clock that stepped back, and a spool whose
state.json write failed after the report was already durable."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

import agents.atomic as atomic
import agents.daemon as daemon
import agents.spool as spoolmod
from agents.__main__ import main
from agents.errors import AgentConfigError
from agents.nics import NicMonitor
from agents.settings import AgentSettings, load_settings
from agents.spool import Spool
from tests.agents.sysfs_tree import SysfsTree
from tests.agents.test_spool import builder

# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("env", "field"),
    [("LABELS", "labels"), ("PREFLIGHT_LOAD_COMMAND", "preflight_load_command")],
)
def test_a_non_json_value_for_a_dict_or_list_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: str, field: str
) -> None:
    monkeypatch.setenv(f"TRAINGUARD_AGENT_{env}", "notjson")
    started: list[AgentSettings] = []
    monkeypatch.setattr(daemon, "run", started.append)
    with pytest.raises(AgentConfigError) as caught:
        load_settings(controller_url="http://c:1")
    assert str(caught.value) == (
        f"invalid agent settings: {field}: TRAINGUARD_AGENT_{env} is not valid JSON "
        "(Expecting value)"
    )
    # The CLI prints that one line and exits 2 (before it would start anything).
    assert main(["--controller", "http://c:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"TRAINGUARD_AGENT_{env} is not valid JSON" in err
    assert "Traceback" not in err and started == []


def _float_fields() -> list[str]:
    return [name for name, info in AgentSettings.model_fields.items() if info.annotation is float]


def test_the_agent_has_float_settings_to_check() -> None:
    assert {"node_base_power_w", "sample_interval_s", "nvml_timeout_s"} <= set(_float_fields())


@pytest.mark.parametrize("field", _float_fields())
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_every_float_setting_must_be_finite(
    monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    monkeypatch.setenv(f"TRAINGUARD_AGENT_{field.upper()}", value)
    with pytest.raises(AgentConfigError) as caught:
        load_settings(controller_url="http://c:1")
    assert str(caught.value).startswith(f"invalid agent settings: {field}: ")
    assert "\n" not in str(caught.value)


def test_infinite_node_base_power_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRAINGUARD_AGENT_NODE_BASE_POWER_W", "inf")
    started: list[AgentSettings] = []
    monkeypatch.setattr(daemon, "run", started.append)  # accepted: the agent never starts
    assert main(["--controller", "http://c:1", "--gpus", "sim:1"]) == 2
    assert capsys.readouterr().err == (
        "python -m agents: error: invalid agent settings: node_base_power_w: "
        "Input should be a finite number\n"
    )
    assert started == []


# ------------------------------------------------------------------ NIC window


def test_a_wall_clock_stepped_back_gives_no_false_error_rise(tmp_path: Path) -> None:
    """symbol_error grows by 1 every 30 s, far under 10 per 60 s; the wall clock steps back
    1 h. The points stamped "in the future" used never to leave the window, so the slow
    trickle summed up to a false nic_errors_rising with a negative span."""
    tree = SysfsTree(tmp_path / "sys").build()
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    start, errors, events = 1_800_000_000.0, 0, []
    for tick in range(200):  # one read per 5 s of real time
        real = tick * 5.0
        if tick % 6 == 0:
            errors += 1
        tree.set_counter("mlx5_0", 1, "symbol_error", errors)
        wall = start + real - (3600 if real >= 300 else 0)
        events += [e for e in mon.sample(wall)[1] if e.kind == "nic_errors_rising"]
    assert events == []


def test_after_a_clock_step_back_a_real_rise_is_still_reported(tmp_path: Path) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    tree.set_counter("mlx5_0", 1, "symbol_error", 0)
    assert mon.sample(1000.0)[1] == []
    tree.set_counter("mlx5_0", 1, "symbol_error", 1)
    assert mon.sample(100.0)[1] == []  # stepped back: counted afresh from here
    tree.set_counter("mlx5_0", 1, "symbol_error", 11)
    rises = [e for e in mon.sample(110.0)[1] if e.kind == "nic_errors_rising"]
    assert [(e.counter, e.delta, e.detail) for e in rises] == [
        ("symbol_error", 10, "mlx5_0 port 1: symbol_error +10 in 10 s")
    ]


# ------------------------------------------------------------------ spool and atomic writes


def _fail_state_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = spoolmod.write_atomic

    def write(path: Path, data: bytes) -> None:
        if path.name == "state.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(spoolmod, "write_atomic", write)


def test_a_failed_state_write_after_the_report_is_durable_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    for _ in range(3):
        spool.append(builder(spool))
    with monkeypatch.context() as m:
        _fail_state_writes(m)
        with caplog.at_level(logging.ERROR, logger="agents.spool"):
            assert spool.append(builder(spool)) == 3  # used to raise OSError
    assert "cannot write" in caplog.text and "No space left" in caplog.text
    assert spool.pending() == [0, 1, 2, 3] and spool.next_seq == 4
    assert json.loads((tmp_path / "state.json").read_text())["next_seq"] == 3
    # A restart recovers next_seq from the newest report.
    assert Spool(tmp_path, max_bytes=10_000_000).next_seq == 4


def test_the_newest_report_is_kept_on_disk_while_state_json_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Report 0 acknowledged and deleted while state.json still said next_seq 0 would make a
    restart reuse seq 0, which the controller drops as a duplicate."""
    spool = Spool(tmp_path, max_bytes=10_000_000)
    instance = spool.agent_instance
    with monkeypatch.context() as m:
        _fail_state_writes(m)
        assert spool.append(builder(spool)) == 0
        spool.acknowledge(0)
        assert spool.pending() == [] and spool.path_for(0).exists()
    reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.agent_instance == instance and reopened.next_seq == 1
    # Once state.json is written again, acknowledging deletes as before.
    assert reopened.append(builder(reopened)) == 1
    reopened.acknowledge(0)
    reopened.acknowledge(1)
    assert reopened.pending() == [] and not reopened.path_for(1).exists()
    assert Spool(tmp_path, max_bytes=10_000_000).next_seq == 2


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_failed_atomic_write_removes_its_tmp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def enospc(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, failing, enospc)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_atomic(target, b"new contents")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert target.read_bytes() == b"old"
