"""A deadlock (ranks waiting for each other in collectives issued in different orders) is
the job's code: remediation restarts the job but never isolates a node for it, even as a
repeat offender, where any other hang on the same node the second time would be isolated.

Without this, a deterministic deadlock came back after every restart and, as a "repeat",
isolated one healthy node after another until the circuit breaker stopped it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.logic.detection.c4d.job_evidence import HangEvidence
from tests.remediation.test_engine import (
    fleet,
    live_test,
    of,
    open_incident,
    recording,
    remediation_over,
)
from tests.waiting import wait_for

POLICY = (
    "rules:\n"
    "  - {kind: hang, steps: [isolate, restart], isolate_when: hardware_or_repeat}\n"
    "  - {kind: '*', steps: [alert]}\n"
    "guards: {settle_s: 0, resume_timeout_s: 1}\n"
)


def hang_evidence(*, deadlock: bool) -> HangEvidence:
    return HangEvidence(
        group="world", seq=18, op="all_reduce", elapsed_s=40.0, entered=[0, 1],
        passed=[], absent=[2, 3], confidence=0.8, deadlock=deadlock or None,
    )  # fmt: skip


def isolations(live: Any, incident: int) -> list[tuple[str, str]]:
    return [(a["status"], a["outcome"]) for a in of(live, incident) if a["kind"] == "isolate_node"]


def hang_twice(live: Any, *, deadlock: bool) -> tuple[int, int]:
    """The same hang on n1 twice, the second after the first restart's resume wait."""
    first = open_incident(
        live, "hang", node="n1", severity="critical", evidence=hang_evidence(deadlock=deadlock)
    )
    remediation_over(live, first)

    def resumed_or_given_up() -> list[Any]:
        rows = of(live, first)
        return [a for a in rows if a["kind"] == "restart_job" and "resume_failed" in a["params"]]

    wait_for(resumed_or_given_up)
    second = open_incident(
        live, "hang", node="n1", severity="critical", evidence=hang_evidence(deadlock=deadlock)
    )
    remediation_over(live, second)
    return first, second


@live_test
@pytest.mark.parametrize("deadlock", [False, True], ids=["hang", "deadlock"])
def test_a_repeated_deadlock_restarts_but_never_isolates(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path, deadlock: bool
) -> None:
    live, _agents = fleet(controller_factory, tmp_path, POLICY, 4)
    recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    first, second = hang_twice(live, deadlock=deadlock)
    restarts = [a for i in (first, second) for a in of(live, i) if a["kind"] == "restart_job"]
    assert len(restarts) == 2, restarts
    if not deadlock:  # the control: a repeat offender is isolated the second time
        assert isolations(live, first) == [
            ("skipped", "not isolating n1: no hardware evidence and its first offence in 3600 s")
        ]
        assert [status for status, _ in isolations(live, second)] == ["succeeded"]
        return
    said = (
        "skipped",
        "not isolating n1: a deadlock (ranks waiting for each other in collectives issued "
        "in different orders) is the job's code, not the node",
    )
    assert isolations(live, first) == [said] and isolations(live, second) == [said]
