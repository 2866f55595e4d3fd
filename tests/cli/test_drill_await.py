"""A drill waits for detection through one API client, not a new one per poll.

Each ``ApiClient`` costs ~20 ms of CPU to build (its TLS context); the wait polls five
times a second, for seconds per fault, in ``trainguard demo`` and the end-to-end tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from trainguard.cli.drill import Drill, DrillConfig, FaultOutcome
from trainguard.cli.procs import ProcessSet


class _Api:
    """Answers ``incidents()`` with nothing until the ``found_on``-th call overall."""

    calls = 0

    def __init__(self, found_on: int) -> None:
        self.found_on = found_on

    def __enter__(self) -> _Api:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass

    def incidents(self) -> list[dict[str, Any]]:
        _Api.calls += 1
        if _Api.calls < self.found_on:
            return []
        return [{"id": 1, "kind": "gpu_fault", "node": "demo-node-0", "opened_unix_s": 101.0}]


def test_detection_wait_builds_one_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Api, "calls", 0)
    drill = Drill(DrillConfig(), tmp_path, ProcessSet(tmp_path / "logs"))
    rows = [
        {"step": 9, "loss": 2.0, "generation": 0, "world_size": 4, "time_unix_s": 100.0},
        {"step": 10, "loss": 1.9, "generation": 1, "world_size": 2, "time_unix_s": 110.0,
         "resumed_from": 10},
    ]  # fmt: skip
    drill.loss_log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    built: list[_Api] = []

    def api() -> _Api:
        built.append(_Api(found_on=3))
        return built[-1]

    monkeypatch.setattr(Drill, "api", lambda self: api())
    outcome = FaultOutcome(
        kind="xid", node="demo-node-0", rank=None, injected_unix_s=100.0,
        generation_before=0, world_before=4,
    )  # fmt: skip
    drill._await(outcome)
    assert _Api.calls == 3 and len(built) == 1
    assert outcome.incident is not None and outcome.incident["id"] == 1
    assert outcome.world_after == 2 and outcome.steps_lost == 0


def test_a_hang_command_that_reaches_the_rank_late_still_hangs_it() -> None:
    """Under load the chaos command can reach the rank after the step it names; a one-step
    fault then never fired and the demo waited out its timeout for a hang that never
    happened. The drill's hang fires at the first step from then on, in its generation only."""
    from collectives.faults import parse_faults
    from trainguard.cli.drill import HANG_LEAD_STEPS, hang_fault

    (fault,) = parse_faults([hang_fault(3, 100, 2)])
    assert fault.kind == "hang" and fault.ranks == {3}
    assert not fault.active(100 + HANG_LEAD_STEPS - 1)
    assert fault.active(100 + HANG_LEAD_STEPS) and fault.active(100 + 5 * HANG_LEAD_STEPS)
    assert fault.generation == 2


def test_a_hang_is_timed_from_the_old_runs_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection time starts when the hung step began (the old run's last completed step),
    wherever the rank hung: not at the injection, 30 steps earlier."""
    monkeypatch.setattr(_Api, "calls", 0)
    drill = Drill(DrillConfig(), tmp_path, ProcessSet(tmp_path / "logs"))
    rows = [
        {"step": s, "loss": 2.0, "generation": 0, "world_size": 4, "time_unix_s": 100.0 + s}
        for s in range(40, 75)  # asked to hang at 70 + 1; the command came late: hung at 75
    ] + [{"step": 71, "loss": 1.9, "generation": 1, "world_size": 4, "time_unix_s": 190.0,
          "resumed_from": 70}]  # fmt: skip
    drill.loss_log.write_text("".join(json.dumps(r) + "\n" for r in rows))

    class _HangApi(_Api):
        def incidents(self) -> list[dict[str, Any]]:
            return [{"id": 2, "kind": "hang", "node": "demo-node-2", "opened_unix_s": 180.0}]

    monkeypatch.setattr(Drill, "api", lambda self: _HangApi(found_on=1))
    outcome = FaultOutcome(
        kind="hang", node="demo-node-2", rank=3, injected_unix_s=141.0,
        generation_before=0, world_before=4,
    )  # fmt: skip
    drill._await(outcome)
    assert outcome.injected_unix_s == 174.0  # step 74's row: the step after it hung
    assert outcome.detect_s == pytest.approx(6.0)
