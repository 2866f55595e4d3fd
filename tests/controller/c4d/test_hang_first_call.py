"""A hang on a group's first call, reported without ``group_ranks``: no member is taken
for an outsider. ``collectives`` numbers a group's calls from 1, so only past the first
call has every member completed one in the group; before that, a rank whose report does
not list the group may still be a member stuck elsewhere (found in review of 8d71b2c)."""

from __future__ import annotations

from controller.logic.detection.c4d.hang import classify
from trainguard.wire import InflightCollective


def rec(rank: int, group: str, seq: int, last: dict[str, int]) -> InflightCollective:
    return InflightCollective(
        job="j", rank=rank, group=group, op="all_reduce", seq=seq, elapsed_s=100,
        last_completed_seq=last,
    )  # fmt: skip


def test_a_member_stuck_elsewhere_before_the_groups_first_call_is_absent() -> None:
    # Rank 0 entered tp-a's first call; rank 1 (its other member) is stuck in dp and never
    # reached tp-a, so its report does not list tp-a.
    recs = [
        rec(0, "tp-a", 1, {"tp-a": 0, "dp": 3}),
        rec(1, "dp", 4, {"dp": 3}),
        rec(2, "dp", 4, {"dp": 3}),
        rec(3, "dp", 4, {"dp": 3}),
    ]
    calls = {c.group: c for c in classify(recs, 4, {r.rank: r.last_completed_seq for r in recs})}
    tp = calls["tp-a"]
    assert 1 in tp.absent and not tp.communication


def test_past_the_first_call_a_rank_that_never_used_the_group_is_not_a_member() -> None:
    # tp-a's third call: ranks 2 and 3 report their groups, and tp-a is not among them.
    recs = [
        rec(0, "tp-a", 3, {"tp-a": 2, "dp": 3}),
        rec(1, "dp", 4, {"tp-a": 2, "dp": 3}),
        rec(2, "dp", 4, {"dp": 3}),
        rec(3, "dp", 4, {"dp": 3}),
    ]
    calls = {c.group: c for c in classify(recs, 4, {r.rank: r.last_completed_seq for r in recs})}
    assert set(calls["tp-a"].absent) == {1}
