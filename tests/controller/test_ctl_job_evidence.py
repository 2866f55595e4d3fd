"""Typed evidence of the job incidents (issue 13): what the C4D detectors write fits the
models the API schema publishes, key for key, and rows of older releases still load.

The detectors build their kind's model (``Finding.evidence``); these tests run them on
synthetic record streams (as ``tests/controller/c4d`` does) and read the JSON every finding
stores, with the keys the job detection service adds, back through ``evidence_kinds``: a key
renamed on either side fails here (``model_extra`` holds what the model does not know).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from controller.logic.detection.c4d import FindingKind, JobTrackers
from controller.logic.detection.c4d.findings import Finding
from controller.logic.detection.c4d.job_evidence import (
    CommFailureEvidence,
    CommSlowEvidence,
    HangEvidence,
    LegacyStragglerEvidence,
    NonfiniteEvidence,
    RankCrashEvidence,
    SlowLinkEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.evidence_kinds import (
    EVIDENCE_BY_KIND,
    evidence_error,
    parse_evidence,
)
from controller.logic.detection.incident_evidence import PowerEvidence, QuarantineBudgetEvidence
from controller.schemas import INCIDENT_ADAPTER, OtherIncidentPublic
from tests.controller.c4d.steps import JOB, node_of, step_records
from trainguard.wire import (
    InflightCollective,
    JobRecords,
    ProbeResult,
    RankEvent,
    StepSummary,
)


def _step(
    step: int,
    world: int,
    *,
    slow: dict[int, float] | None = None,
    comm_s: float = 0.1,
    nan: dict[int, int] | None = None,
) -> list[StepSummary]:
    """A step of the shared synthetic stream; ranks in ``nan`` saw a non-finite input at
    that sequence number of their first collective."""
    rows = step_records(step, world, compute=slow, comm_s=comm_s, jitter=0.05)
    return [
        StepSummary.model_validate(
            row.model_dump()
            | {
                "nonfinite_inputs": 1,
                "nonfinite_first_op": "all_reduce",
                "nonfinite_first_group": "w0",
                "nonfinite_first_seq": nan[row.rank],
            }
        )
        if nan and row.rank in nan
        else row
        for row in rows
    ]


def _run(trackers: JobTrackers, steps: range, **kw: Any) -> list[Finding]:
    found: list[Finding] = []
    for step in steps:
        for row in _step(step, **kw):
            trackers.observe(node_of(row.rank), JobRecords(steps=[row]), float(step))
        found += trackers.evaluate(float(step))
    return found


def _inflight(rank: int, members: list[int]) -> InflightCollective:
    return InflightCollective(
        job=JOB,
        rank=rank,
        group="world",
        op="all_reduce",
        seq=17,
        elapsed_s=12.0,
        group_ranks=members,
        last_completed_seq={"world": 16},
        step=40,
    )


def _exited(rank: int, *, code: int = 1, collateral: bool = False) -> RankEvent:
    return RankEvent(
        job=JOB,
        rank=rank,
        kind="exited",
        exit_code=code,
        time_unix_s=1.0,
        world_size=8,
        collective_failed=collateral,
        error="RuntimeError: Connection closed by peer" if collateral else "",
    )


def _findings() -> dict[FindingKind, Finding]:
    """One finding of every kind the job detectors report, from real detector runs."""
    out: dict[FindingKind, Finding] = {}

    def keep(found: list[Finding]) -> None:
        for f in found:
            if not f.resolved:
                out.setdefault(f.kind, f)

    trackers = JobTrackers()
    keep(_run(trackers, range(30), world=8, slow={5: 1.3}))
    trackers = JobTrackers()
    keep(_run(trackers, range(50), world=8))
    keep(_run(trackers, range(50, 60), world=8, comm_s=0.4))
    trackers = JobTrackers()
    keep(_run(trackers, range(10), world=8))
    keep(_run(trackers, range(10, 14), world=8, nan={2: 41, 3: 42}))
    # Hang: rank 2 never entered; communication hang: all four did.
    trackers = JobTrackers()
    _run(trackers, range(1), world=8)
    for r in (0, 1, 3, 4, 5, 6, 7):
        trackers.observe(node_of(r), JobRecords(inflight=[_inflight(r, [])]), 100.0)
    keep(trackers.evaluate(100.0))
    trackers = JobTrackers()
    _run(trackers, range(1), world=4)
    for r in range(4):
        trackers.observe(node_of(r), JobRecords(inflight=[_inflight(r, [])]), 10.0)
    keep(trackers.evaluate(10.0))
    # A probe round with one slow rank.
    trackers = JobTrackers()
    _run(trackers, range(1), world=8)
    size = 8 << 20
    gbps = {(i, (i + 1) % 8): 100.0 for i in range(8)} | {(1, 2): 10.0, (2, 3): 10.0}
    probes = [
        ProbeResult(
            job=JOB,
            probe_id="p1",
            src_rank=a,
            dst_rank=b,
            size_bytes=size,
            duration_s=size * 8 / (g * 1e9),
        )
        for (a, b), g in gbps.items()
    ]
    trackers.observe("node-0", JobRecords(probes=probes), 0.0)
    finding = trackers.jobs[JOB].finish_probe("p1")
    assert finding is not None
    keep([finding])
    # A crash, and collective failures with no crash.
    trackers = JobTrackers()
    trackers.observe("node-1", JobRecords(rank_events=[_exited(6, code=7)]), 0.0)
    keep(trackers.evaluate(60.0))
    trackers = JobTrackers()
    trackers.observe("node-0", JobRecords(rank_events=[_exited(1, collateral=True)]), 0.0)
    trackers.observe("node-1", JobRecords(rank_events=[_exited(4, collateral=True)]), 1.0)
    keep(trackers.evaluate(11.0))
    return out


MODELS: dict[FindingKind, type[BaseModel]] = {
    FindingKind.STRAGGLER: StragglerIncidentEvidence,
    FindingKind.COMM_SLOW: CommSlowEvidence,
    FindingKind.NONFINITE: NonfiniteEvidence,
    FindingKind.HANG: HangEvidence,
    FindingKind.COMM_HANG: HangEvidence,
    FindingKind.SLOW_LINK: SlowLinkEvidence,
    FindingKind.RANK_CRASH: RankCrashEvidence,
    FindingKind.COMM_FAILURE: CommFailureEvidence,
}


def test_every_finding_kind_is_an_incident_kind_with_a_model() -> None:
    assert set(MODELS) == set(FindingKind)
    assert {str(k) for k in FindingKind} <= set(EVIDENCE_BY_KIND)


def test_detector_evidence_fits_its_model_key_for_key() -> None:
    found = _findings()
    assert set(found) == set(FindingKind), f"no finding of {set(FindingKind) - set(found)}"
    for kind, finding in found.items():
        assert type(finding.evidence) is MODELS[kind], (kind, type(finding.evidence))
        # What the job detection service stores: the finding's evidence and its nodes.
        stored = {**finding.evidence.as_json(), "nodes": list(finding.nodes)}
        assert evidence_error(str(kind), stored) is None, (kind, stored)
        parsed = parse_evidence(str(kind), stored)
        assert isinstance(parsed, MODELS[kind]), (kind, parsed)
        # No key the model does not name (a renamed key would land here), none lost.
        assert not parsed.model_extra, (kind, parsed.model_extra)
        assert parsed.model_dump(mode="json") == stored, kind


#: Evidence as older releases wrote it (from the git history of the detectors).
OLD_ROWS: dict[str, tuple[dict[str, Any], type[BaseModel]]] = {
    # Before peer groups (issue 16): six numbers, no peers.
    "straggler": (
        {
            "slowdown_pct": 25.0,
            "step_cost_pct": 18.2,
            "gpu_index": 1,
            "score": 1.25,
            "confidence": 0.9,
            "window_steps": 20,
            "nodes": ["node-1"],
            "gpu": {},
            "causes": [],
        },
        LegacyStragglerEvidence,
    ),
    # Before rollback counted bad steps.
    "nonfinite": (
        {
            "step": 10,
            "op": "all_reduce",
            "group": "w0",
            "seq": 41,
            "origin_ranks": [2],
            "nonfinite_ranks": [0, 1, 2, 3],
            "first_seq_by_rank": {"2": 41},
            "nonfinite_calls_by_rank": {"2": 1},
            "clean_ranks": 0,
            "gpu_index": 2,
            "confidence": 1.0,
            "nodes": ["node-1"],
        },
        NonfiniteEvidence,
    ),
    # Before NIC suspects (issue 17).
    "comm_slow": (
        {
            "reference_wait_s": 0.1,
            "wait_s": 0.4,
            "step_s": 1.4,
            "confidence": 0.5,
            "nodes": ["node-0", "node-1"],
        },
        CommSlowEvidence,
    ),
    # Before the deferred probe and the Flight Recorder.
    "comm_hang": (
        {
            "group": "world",
            "seq": 17,
            "op": "all_reduce",
            "elapsed_s": 12.0,
            "entered": [0, 1, 2, 3],
            "passed": [],
            "absent": [],
            "confidence": 0.5,
            "nodes": ["node-0"],
        },
        HangEvidence,
    ),
    "power_brake": (
        {
            "domain": "row-a",
            "policy_kind": "brake",
            "budget_w": 9000.0,
            "power_w": 9800.5,
            "level": "ROW",
            "events": [{"time_unix_s": 1.0, "message": "brake"}],
        },
        PowerEvidence,
    ),
    "quarantine_budget": (
        {
            "refused_node": "n4",
            "quarantined_in_window": 2,
            "limit": 2,
            "fleet": 20,
            "window_s": 3600.0,
        },
        QuarantineBudgetEvidence,
    ),
}


@pytest.mark.parametrize("kind", sorted(OLD_ROWS))
def test_rows_of_older_releases_load_typed_and_unchanged(kind: str) -> None:
    row, model = OLD_ROWS[kind]
    parsed = parse_evidence(kind, row)
    assert isinstance(parsed, model)
    assert parsed.model_dump(mode="json") == row  # nothing added, nothing lost
    # The API serves it as the typed shape of its kind, evidence as stored.
    served = INCIDENT_ADAPTER.validate_python(_incident(kind, row))
    assert not isinstance(served, OtherIncidentPublic)
    assert INCIDENT_ADAPTER.dump_python(served, mode="json")["evidence"] == row


def _incident(kind: str, evidence: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "id": 1,
        "kind": kind,
        "severity": "warning",
        "state": "resolved",
        "summary": "old",
        "node": None,
        "gpu_index": None,
        "job": None,
        "ranks": [],
        "evidence": evidence,
        "count": 1,
        "opened_unix_s": 1.0,
        "updated_unix_s": 1.0,
        "resolved_unix_s": 2.0,
        **more,
    }


def test_a_row_that_fits_no_model_is_served_untyped_with_the_reason() -> None:
    damaged = {"reasons": "not a list"}
    error = evidence_error("gpu_fault", damaged)
    assert error is not None and error.startswith("reasons")
    served = INCIDENT_ADAPTER.validate_python(_incident("gpu_fault", damaged, evidence_error=error))
    assert isinstance(served, OtherIncidentPublic) and served.evidence == damaged
    # A kind without a model (another release's) is untyped, with no error to report.
    assert evidence_error("power_future", {"x": 1}) is None
    other = INCIDENT_ADAPTER.validate_python(
        _incident("power_future", {"x": 1}, evidence_error=None)
    )
    assert isinstance(other, OtherIncidentPublic)
    # Without the reason a typed kind must fit its model: the schema's shapes stay exclusive.
    with pytest.raises(ValueError, match="reasons"):
        INCIDENT_ADAPTER.validate_python(_incident("gpu_fault", damaged))


def test_the_cli_reads_evidence_through_the_same_models() -> None:
    from trainguard.cli.views import incident_evidence_cell

    row, _ = OLD_ROWS["straggler"]
    cell = incident_evidence_cell({"kind": "straggler", "evidence": row})
    assert cell == "slowdown_pct=25.0,step_cost_pct=18.2,confidence=0.9"
    hang, _ = OLD_ROWS["comm_hang"]
    cell = incident_evidence_cell({"kind": "comm_hang", "evidence": hang})
    assert cell == "op=all_reduce,seq=17,group=world,confidence=0.5"
    # Flagged by the API, or of a kind without a model: shown as it came.
    damaged = {"kind": "gpu_fault", "evidence": {"reasons": 3}, "evidence_error": "reasons: …"}
    assert incident_evidence_cell(damaged) == "reasons=3"
    assert incident_evidence_cell({"kind": "power_future", "evidence": {"x": 1}}) == "x=1"
    # A shape this CLI's model does not know (a server of another release): as it came.
    assert incident_evidence_cell({"kind": "gpu_fault", "evidence": {"reasons": 3}}) == "reasons=3"


def test_straggler_gpu_cause_facts_fit_their_model() -> None:
    """``gpu`` of a straggler's evidence: what ``straggler_cause`` returns, key for key."""
    from controller.logic.detection.c4d.job_evidence import GpuCauseFacts
    from controller.logic.detection.cause import straggler_cause
    from trainguard.wire import GpuSample

    hot = GpuSample(index=0, sm_clock_mhz=1200, temperature_c=91.0, ecc_corrected_total=5000,
                    throttle_reasons=["hw_thermal_slowdown"])  # fmt: skip
    causes, facts = straggler_cause(hot, [GpuSample(index=1, sm_clock_mhz=1980)] * 2)
    assert causes
    parsed = GpuCauseFacts.model_validate(facts)
    assert not parsed.model_extra and parsed.model_dump(mode="json") == facts
    assert parsed.peer_sm_clock_mhz == 1980 and parsed.ecc_corrected_total == 5000
