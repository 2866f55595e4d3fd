"""Peer groups of 3-D (TP x PP x DP) jobs and the hang bookkeeping at scale (acceptance probe).

* A summary that carries its pipeline stage but no role or peer list (a rank that declared
  only ``set_role(pp_stage=n)``) is in its stage's group: the last stage, 1.3x slower by
  design, is not sixteen stragglers (probe p1 scenario H).
* A rank whose reported peer list disagrees with the others' (rank 7 of stage 3 listing
  stage 2's ranks) is compared with the ranks that list it, not left out of every
  comparison (probe p14, p1 scenario G).
* A summary drops only its own rank's in-flight records, without looking at every rank's
  (probe p11: 8,192 records of a 4,096-rank job made each summary cost ~1 ms).

Plain data, no sockets, no clock: summaries of a synchronous job (everyone waits for the
slowest) in a Megatron-like layout, rank = (dp * PP + pp) * TP + tp.
"""

from __future__ import annotations

import random
from typing import Any

from controller.logic.detection.c4d import Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.evidence import StragglerEvidence
from controller.logic.detection.c4d.peers import PeerIndex, PeerKey
from trainguard.wire import InflightCollective, JobRecords, StepSummary

JOB = "megatron"
TP, PP, DP = 2, 4, 8
WORLD = TP * PP * DP
#: Stage 3 computes the loss: 30% longer by design.
STAGE_COST = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.3}


def stage_of(rank: int) -> int:
    return rank // TP % PP


STAGES = {p: [r for r in range(WORLD) if stage_of(r) == p] for p in range(PP)}


def summary(
    rank: int, step: int, compute: float, top: float, world: int = WORLD, **fields: Any
) -> StepSummary:
    return StepSummary(
        job=JOB,
        rank=rank,
        world_size=world,
        step=step,
        compute_time_s=compute,
        collective_wait_s=top - compute + 0.1,
        step_time_s=top + 0.1,
        gpu_index=rank % 8,
        **fields,
    )


def run(
    steps: int, fields: Any, slow: dict[int, float] | None = None, seed: int = 1
) -> tuple[JobTrackers, list[Finding]]:
    """``steps`` synchronous steps; ``fields(rank)``: the rank's role fields."""
    rng = random.Random(seed)
    trackers = JobTrackers()
    found: list[Finding] = []
    for step in range(steps):
        compute = {
            r: STAGE_COST[stage_of(r)] * (slow or {}).get(r, 1.0) * (1 + rng.uniform(-0.05, 0.05))
            for r in range(WORLD)
        }
        top = max(compute.values())
        for node in range(WORLD // 8):
            rows = [
                summary(r, step, compute[r], top, **fields(r))
                for r in range(8 * node, 8 * node + 8)
            ]
            trackers.observe(f"n{node}", JobRecords(steps=rows), float(step))
        found += trackers.evaluate(float(step))
    return trackers, found


def opened(found: list[Finding]) -> list[tuple[int, ...]]:
    return [
        f.ranks for f in found if f.kind is FindingKind.STRAGGLER and not (f.resolved or f.refresh)
    ]


# ---------------------------------------------------------------- a declared stage


def test_a_stage_without_role_or_peer_list_is_its_own_peer_group() -> None:
    index = PeerIndex()
    key = index.key(summary(6, 0, 1.0, 1.0, pp_stage=3))
    assert key == PeerKey("pp_stage=3", ())
    assert index.key(summary(4, 0, 1.0, 1.0, pp_stage=2)) != key
    # A declared role still names the group; the stage does not override it.
    assert index.key(summary(6, 1, 1.0, 1.0, pp_stage=3, role="loss")) == PeerKey("loss", ())


def test_the_slower_last_stage_is_not_called_stragglers_when_only_stages_are_reported() -> None:
    trackers, found = run(120, lambda r: {"pp_stage": stage_of(r), "tp_rank": r % TP})
    assert opened(found) == []
    state = trackers.jobs[JOB].stragglers
    assert sorted(state.groups[PeerKey("pp_stage=3", ())].scores) == STAGES[3]


# ---------------------------------------------------------------- disagreeing peer lists


def _stage_fields(liar: int, listed_stage: int) -> Any:
    def fields(r: int) -> dict[str, Any]:
        stage = stage_of(r)
        group = STAGES[listed_stage] if r == liar else STAGES[stage]
        return {"role": f"pp_stage={stage}", "pp_stage": stage, "group_ranks": group}

    return fields


def test_a_rank_listing_another_stage_is_compared_with_the_ranks_that_list_it() -> None:
    """Rank 7 (stage 3) reports stage 2's ranks as its peers and computes 30% longer than
    its stage: it was scored in no group, and nothing opened."""
    trackers, found = run(200, _stage_fields(7, 2), slow={7: 1.3})
    assert opened(found) == [(7,)]
    state = trackers.jobs[JOB].stragglers
    stage3 = PeerKey("pp_stage=3", tuple(STAGES[3]))
    assert state.rank_group[7] == stage3 and 7 in state.groups[stage3].scores
    first = next(f for f in found if f.kind is FindingKind.STRAGGLER)
    ev = StragglerEvidence.model_validate(first.evidence)
    assert ev.peer_group.ranks == STAGES[3] and "list it" in ev.peer_group.why


def test_a_rank_listing_another_stage_but_as_fast_as_its_own_opens_nothing() -> None:
    """The same misreport on a healthy rank: compared with stage 3, not with stage 2
    (against which its 1.3x by design would look slow)."""
    _, found = run(200, _stage_fields(7, 2))
    assert opened(found) == []


def _row(rank: int, role: str = "", group: list[int] | None = None) -> StepSummary:
    return summary(rank, 0, 1.0, 1.0, role=role or None, group_ranks=group or [])


def test_a_peer_list_nobody_else_reports_settles_then_is_a_group_of_one() -> None:
    """Rank 0 lists [0, 1]; rank 1 reports no group. Held out while reports settle (a peer
    may report the same list a step later), then compared with its own history."""
    from controller.logic.detection.c4d.peers import SETTLE_STEPS, PeerGroups

    peers = PeerGroups()
    rows = [_row(0, "pp_stage=0", [0, 1]), _row(1), _row(2), _row(3)]
    pair = PeerKey("pp_stage=0", (0, 1))
    for step in range(SETTLE_STEPS):
        peers.update(rows, step)
        assert peers.group(0) is None
    peers.update(rows, SETTLE_STEPS)
    assert peers.group(0) == pair and peers.alone(pair)
    # Rank 1 comes to report the same list: a pair, compared together.
    rows[1] = _row(1, "pp_stage=0", [0, 1])
    moved = peers.update(rows, SETTLE_STEPS + 1)
    assert peers.group(1) == pair and not peers.alone(pair)
    assert dict(moved) == {1: PeerKey("", ())}


def test_a_rank_left_out_of_its_own_list_joins_a_role_group_of_its_role() -> None:
    from controller.logic.detection.c4d.peers import SETTLE_STEPS, PeerGroups

    peers = PeerGroups()
    rows = [_row(0, "expert", [2, 3]), _row(1, "expert"), _row(2, "expert"), _row(3, "dense")]
    for step in range(SETTLE_STEPS + 1):
        peers.update(rows, step)
    assert peers.group(0) == PeerKey("expert", ()) == peers.group(1)


# ---------------------------------------------------------------- in-flight bookkeeping


class _CountedRank(int):
    """A rank number that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedRank.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_a_summary_looks_only_at_its_own_ranks_in_flight_records() -> None:
    """4,096 ranks, two stuck calls each whose step is unknown (kept until they expire):
    each summary used to compare its rank with all 8,192 records' ranks."""
    world = 4096
    trackers = JobTrackers()
    tracker = trackers.tracker(JOB)
    for r in range(world):
        for group in (f"tp{r // 8}", f"dp{r % 8}"):
            rec = InflightCollective.model_construct(
                job=JOB,
                rank=_CountedRank(r),
                group=group,
                op="all_reduce",
                seq=5,
                elapsed_s=8.0,
                size_bytes=0,
                last_completed_seq={},
                step=None,
                group_ranks=[],
            )
            tracker.observe_inflight("n", rec, 3.0)
    _CountedRank.compared = 0
    for r in range(256):
        tracker.observe_step("n", summary(r, 4, 1.0, 1.0, world), 4.0)
    assert len(tracker.inflight) == 2 * world  # step unknown: they stay until they expire
    assert _CountedRank.compared <= 4 * 256
    # A record of an earlier step is dropped by the rank's next summary, and only its.
    stuck = InflightCollective(job=JOB, rank=3, group="pp", op="send", seq=1, elapsed_s=9.0, step=2)
    tracker.observe_inflight("n", stuck, 5.0)
    tracker.observe_step("n", summary(2, 5, 1.0, 1.0, world), 5.0)
    assert (3, "pp") in tracker.inflight
    tracker.observe_step("n", summary(3, 5, 1.0, 1.0, world), 5.0)
    assert (3, "pp") not in tracker.inflight and len(tracker.inflight) == 2 * world


# ---------------------------------------------------------------- hangs without member lists


def _stuck(rank: int, group: str, seq: int, op: str, done: dict[str, int]) -> InflightCollective:
    """A stuck call whose record lacks ``group_ranks`` (an older or foreign reporter)."""
    return InflightCollective(
        job=JOB, rank=rank, group=group, op=op, seq=seq, elapsed_s=15.0, last_completed_seq=done
    )


def _hangs(
    world: int, records: list[InflightCollective]
) -> list[tuple[FindingKind, tuple[int, ...]]]:
    trackers = JobTrackers()
    rows = [summary(r, 0, 1.0, 1.0, world) for r in range(world)]
    trackers.observe("n0", JobRecords(steps=rows), 0.0)
    trackers.evaluate(0.0)
    for rec in records:
        trackers.observe(f"n{rec.rank // 8}", JobRecords(inflight=[rec]), 20.0)
    return sorted((f.kind, f.ranks) for f in trackers.evaluate(20.0))


def test_a_stuck_send_on_a_p2p_channel_names_its_partner_not_the_world() -> None:
    """Rank 26 sends to 28, which never posts the receive: the channel id names the pair
    (the world was assumed: a critical hang naming the 62 other ranks)."""
    found = _hangs(WORLD, [_stuck(26, "p2p-26-28", 7, "send", {"p2p-26-28": 6})])
    assert found == [(FindingKind.HANG, (28,))]


def test_a_tp_pair_both_inside_a_sized_group_is_a_communication_hang_of_the_pair() -> None:
    done = {"g2-5f0c1d2e3a4b": 49}
    records = [_stuck(r, "g2-5f0c1d2e3a4b", 50, "all_reduce", done) for r in (10, 11)]
    assert _hangs(WORLD, records) == [(FindingKind.COMM_HANG, (10, 11))]


def test_ranks_whose_reports_leave_a_group_out_are_not_its_members() -> None:
    """Ranks 0, 2, 4, 6 are all inside "even" #5 (no member list, an unsized id); 1, 3, 5,
    7 are inside "odd" #5 and list only "odd" among their groups. Assumed the world, "even"
    had four absentees, all waiting elsewhere, so it was dropped as a victim's call."""
    records = [_stuck(r, "even", 5, "all_reduce", {"even": 4}) for r in (0, 2, 4, 6)]
    records += [
        _stuck(r, "odd", 5, "all_reduce", {"odd": 4}).model_copy(
            update={"group_ranks": [1, 3, 5, 7]}
        )
        for r in (1, 3, 5, 7)
    ]
    assert _hangs(8, records) == [
        (FindingKind.COMM_HANG, (0, 2, 4, 6)),
        (FindingKind.COMM_HANG, (1, 3, 5, 7)),
    ]
