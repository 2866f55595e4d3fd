"""Rank numbers inside a report's payload, from a buggy or hostile agent: what can never be
valid is refused at the wire (422 naming the field); what only the job's world size can tell
is ignored by the detectors, which never blame a rank the job does not have and never raise.

Before, ``p2p-0-999999999``, ``group_ranks: [0, 2**31 - 1]``, an in-flight record or rank
event from rank 999 of an 8-rank job and a probe result for a pair nobody asked about all
became critical findings naming non-existent ranks (or, worse, every real rank).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from controller.logic.detection.c4d import C4DConfig, FindingKind, JobTrackers
from controller.logic.detection.c4d.findings import Finding
from controller.logic.detection.c4d.hang import classify
from tests import http_calls
from tests.controller.c4d.steps import JOB, node_of, step_records
from trainguard import wire
from trainguard.wire import InflightCollective, JobRecords, ProbeResult, RankEvent, StepSummary

WORLD = 8
HUGE = 2**31 - 1

# --------------------------------------------------------------------------- the wire

STEP = {
    "job": JOB,
    "rank": 0,
    "world_size": WORLD,
    "step": 1,
    "step_time_s": 1.0,
    "compute_time_s": 1.0,
    "collective_wait_s": 0.0,
}
INFLIGHT = {"job": JOB, "rank": 0, "group": "g", "op": "all_reduce", "seq": 1, "elapsed_s": 1.0}


@pytest.mark.parametrize(
    ("model", "fields", "message"),
    [
        (StepSummary, STEP | {"group_ranks": [0, 3, 3]}, "rank 3 is listed twice"),
        (wire.PeerGroup, {"job": JOB, "id": "pg", "ranks": [1, 2, 1]}, "rank 1 is listed twice"),
        (InflightCollective, INFLIGHT | {"group_ranks": [0, 0]}, "rank 0 is listed twice"),
        (
            wire.FlightRecorderDump,
            {"job": JOB, "rank": 0, "pg_ranks": {"0": [0, 1, 1]}},
            "rank 1 is listed twice",
        ),
        (
            wire.FlightRecorderDump,
            {"job": JOB, "rank": 0, "pg_ranks": {str(i): [0] for i in range(4097)}},
            "at most 4096",
        ),
        (
            wire.JobLinkProbe,
            {"id": "c", "job": JOB, "at_step": 1, "pairs": [(0, 2**31)]},
            "less than or equal to 2147483647",
        ),
    ],
)
def test_rank_references_that_can_never_be_valid_are_refused(
    model: type[wire.WireModel], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError) as err:
        model.model_validate(fields)
    assert message in str(err.value)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_group_rank_listed_twice_is_a_422_naming_the_field(
    controller_factory: Any, ctl_report: Any
) -> None:
    live = controller_factory()
    step = STEP | {"world_size": 2, "group_ranks": [0, 1, 1], "end_unix_s": time.time()}
    body = ctl_report("node-a", 1, gpus=1, samples=1) | {"job": {"steps": [step]}}
    r = http_calls.post(
        f"{live.url}/api/v1/reports", json=body, headers=live.headers("agent"), timeout=10
    )
    assert r.status_code == 422, r.text
    assert "group_ranks" in r.text and "rank 1 is listed twice" in r.text, r.text


# --------------------------------------------------------------------------- at use


def _job(world: int = WORLD) -> JobTrackers:
    trackers = JobTrackers()
    for s in step_records(0, world):
        trackers.observe(node_of(s.rank), JobRecords(steps=[s]), 0.0)
    return trackers


def _stuck(rank: int, group: str, members: list[int] | None = None) -> InflightCollective:
    return InflightCollective(
        job=JOB, rank=rank, group=group, op="send", seq=17, elapsed_s=100.0,
        group_ranks=members or [], last_completed_seq={group: 16}, step=40,
    )  # fmt: skip


def _names(findings: list[Finding]) -> set[int]:
    return {r for f in findings for r in (*f.ranks, *(p for pair in f.probe_pairs for p in pair))}


def _evaluate(trackers: JobTrackers, now: float) -> list[Finding]:
    found = trackers.evaluate(now)
    assert not any(r >= WORLD or r < 0 for r in _names(found)), found
    return found


@pytest.mark.parametrize(
    "rec",
    [
        _stuck(0, "p2p-0-999999999"),  # was: a critical hang blaming rank 999999999
        _stuck(0, "p2p-0-8"),  # the first rank past the world
        _stuck(3, "p2p-3-3"),  # a channel to itself
        _stuck(0, "tp", [0, HUGE]),  # was: a hang blaming rank 2147483647
        _stuck(3, "tp01", [0, 1]),  # the reporter outside its own group: was 0, 1 blamed
        _stuck(5, "p2p-0-1"),  # the same through a point-to-point id
    ],
    ids=["p2p-huge", "p2p-world", "p2p-self", "group-huge", "group-without-me", "p2p-without-me"],
)
def test_a_contradicted_membership_blames_nobody(rec: InflightCollective) -> None:
    trackers = _job()
    trackers.observe(node_of(rec.rank), JobRecords(inflight=[rec]), 1.0)
    found = _evaluate(trackers, 1.0)
    assert [f for f in found if f.kind in (FindingKind.HANG, FindingKind.COMM_HANG)] == []


def test_a_real_hang_beside_a_hostile_record_is_still_found() -> None:
    trackers = _job()
    recs = [_stuck(0, "p2p-0-1"), _stuck(2, "p2p-2-999"), _stuck(9, "world")]
    trackers.observe("node-0", JobRecords(inflight=recs), 1.0)
    (hang,) = _evaluate(trackers, 1.0)
    assert (hang.kind, hang.ranks, hang.nodes) == (FindingKind.HANG, (1,), ("node-0",))


def test_an_inflight_record_from_a_rank_outside_the_world_is_ignored() -> None:
    """Was: rank 999's lone record made a critical hang blaming all 8 real ranks, and put
    rank 999 among the job's ranks (a later comm_slow finding would name it)."""
    trackers = _job()
    trackers.observe("node-x", JobRecords(inflight=[_stuck(999, "world")]), 1.0)
    assert _evaluate(trackers, 1.0) == []
    assert 999 not in trackers.jobs[JOB].rank_node


@pytest.mark.parametrize("world_size", [None, 1000])
def test_a_crash_of_a_rank_outside_the_world_names_nobody(world_size: int | None) -> None:
    """Was: ``rank 999 of job ... died (exit code 1)``, critical. A lone claim of a larger
    world (1000) does not outvote the job's eight ranks either."""
    trackers = _job()
    ev = RankEvent(
        job=JOB, rank=999, kind="exited", exit_code=1, time_unix_s=1.0, world_size=world_size
    )
    trackers.observe("node-x", JobRecords(rank_events=[ev]), 1.0)
    assert _evaluate(trackers, 100.0) == []
    assert trackers.jobs[JOB].world_size == WORLD


def test_a_probe_result_naming_a_rank_outside_the_world_is_no_evidence() -> None:
    """Was: the one slow pair (0, 99) made a slow_link finding blaming ranks 0 and 99."""
    trackers = _job()
    ring = [(r, (r + 1) % WORLD) for r in range(WORLD)]
    results = [
        ProbeResult(job=JOB, probe_id="p", src_rank=a, dst_rank=b, size_bytes=1 << 20,
                    duration_s=0.001)
        for a, b in ring
    ] + [ProbeResult(job=JOB, probe_id="p", src_rank=0, dst_rank=99, size_bytes=1 << 20,
                     duration_s=10.0)]  # fmt: skip
    trackers.observe("node-0", JobRecords(probes=results), 1.0)
    assert trackers.jobs[JOB].finish_probe("p") is None


def test_a_peer_group_naming_a_rank_outside_the_world_is_no_peer_group() -> None:
    """``group_ranks`` filled in by ingest from a declared PeerGroup (which the wire cannot
    check against the world size). Was: the straggler's evidence named its group by a list
    holding rank 999, in its label and its reason."""
    trackers = JobTrackers()
    ghost = [*range(WORLD), 999]
    found: list[Finding] = []
    for step in range(30):
        for s in step_records(step, WORLD, compute={2: 1.3}):
            records = JobRecords(steps=[s])
            records.steps[0].group_ranks = ghost  # as ingest assigns it, after validation
            trackers.observe(node_of(s.rank), records, float(step))
        found += _evaluate(trackers, float(step))
    (straggler,) = [f for f in found if f.kind is FindingKind.STRAGGLER]
    assert straggler.ranks == (2,)
    group = straggler.evidence.as_json()["peer_group"]
    assert "999" not in json.dumps(group), group  # was in its label and its "why"


def test_a_world_no_group_can_have_is_not_materialized() -> None:
    """All of a job's reports agreeing on a world of 2**31 - 1 ranks (possible only for a
    hostile reporter) made every hang check build a set of that many ranks: gigabytes, per
    tick. No group is larger than ``MAX_GROUP_RANKS``; the call's known ranks stand."""
    world = wire.MAX_GROUP_RANKS + 1
    rec = _stuck(0, "world")
    (call,) = classify([rec], world, {0: rec.last_completed_seq})
    assert call.members == (0,) and call.absent == ()


def test_the_detector_tick_survives_every_hostile_record_at_once() -> None:
    cfg = C4DConfig()
    trackers = JobTrackers(cfg)
    for s in step_records(0, WORLD):
        trackers.observe(node_of(s.rank), JobRecords(steps=[s]), 0.0)
    # Accepted at the wire (only the world size tells them wrong): a mock mesh job-side
    # gives any ranks, and a refusal there must not stop training.
    ghost = StepSummary.model_validate(STEP | {"step": 1, "group_ranks": [0, 999], "pp_stage": 9})
    hostile = JobRecords(
        steps=[ghost],
        inflight=[
            _stuck(0, "p2p-0-999999999"),
            _stuck(1, "tp", [1, HUGE]),
            _stuck(HUGE, "world"),
            _stuck(2, "g999999999999999999999999-x"),
        ],
        rank_events=[RankEvent(job=JOB, rank=HUGE, kind="exited", exit_code=9, time_unix_s=1)],
        probes=[ProbeResult(job=JOB, probe_id="p", src_rank=HUGE, dst_rank=0, size_bytes=1,
                            duration_s=0.0, ok=False)],
    )  # fmt: skip
    trackers.observe("node-x", hostile, 1.0)
    for now in (1.0, 50.0, 100.0):
        _evaluate(trackers, now)
    assert trackers.jobs[JOB].finish_probe("p") is None
