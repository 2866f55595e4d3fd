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
