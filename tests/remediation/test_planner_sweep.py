"""Acceptance sweep of job layouts and pool states for the restart planner and the
isolation budgets.

``test_planner.py`` pins the planner's rules one by one on small 1- and 2-rank-per-node
layouts (plus hypothesis invariants); ``test_fault_timeline_sweep.py`` pins sequences of
plans. This module sweeps the *shapes* an operator runs: whole-node tensor parallelism
(TP=8 on 8 GPUs), TP=2 on 8-GPU nodes, single-node jobs, several culprits at once, spares
that must never be picked, grow-back after a release, hostile configuration, and the
circuit breaker on fleets of 1-3 nodes. Each test states what a mature tool must plan, not
how the planner gets there. Plain data only: no controller, no clock.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest

from controller.actuators.k8s.partition import PartitionSettings, quarantine_limit
from controller.logic.remediation.guards import breaker_limit, circuit_breaker
from controller.logic.remediation.placement import Placement
from controller.logic.remediation.planner import RestartPlan, plan_restart
from controller.logic.remediation.rules import Guards


def job(nodes: str, rpn: int = 8, tp: int = 8, generation: int = 0) -> Placement:
    return Placement(
        job="gpt", nodes=tuple(nodes.split()), ranks_per_node=rpn, tp=tp, generation=generation
    )


def placed(plan: RestartPlan) -> Placement:
    assert plan.placement is not None, plan.reason
    return plan.placement


def assert_tp_groups_whole(p: Placement) -> None:
    """Every tensor-parallel group (``tp`` consecutive ranks) lives on one node and none is
    partial: a TP group split over two nodes would run its all-reduces over the network."""
    assert p.world_size % p.tp == 0
    for first in range(0, p.world_size, p.tp):
        assert len({p.node_of(r) for r in range(first, first + p.tp)}) == 1, first


# (1) TP=8 over a whole 8-GPU node, DP=4 ------------------------------------------------


def test_tp8_whole_node_losing_one_node_shrinks_to_dp3_in_whole_replicas() -> None:
    plan = plan_restart(job("a b c d"), ["a", "b", "c", "d"], {"b"})
    new = placed(plan)
    assert plan.kind == "shrink" and new.dp == 3 and new.tp == 8
    assert new.nodes == ("a", "d", "c") and plan.dropped == ["b"]
    assert_tp_groups_whole(new)
    assert "dp 4 -> 3, world 32 -> 24" in plan.reason


def test_tp8_whole_node_uses_a_spare_before_shrinking() -> None:
    plan = plan_restart(job("a b c d"), ["a", "b", "c", "d", "s"], {"b"})
    new = placed(plan)
    assert plan.kind == "same_size" and new.nodes == ("a", "s", "c", "d") and new.dp == 4
    assert_tp_groups_whole(new)


def test_tp8_whole_node_shrinks_past_dp3_when_the_batch_needs_it() -> None:
    # dp=3 does not divide a global batch of 64: two replicas, never a TP group cut.
    plan = plan_restart(job("a b c d"), ["a", "b", "c", "d"], {"b"}, dp_must_divide=64)
    new = placed(plan)
    assert new.dp == 2 and new.nodes == ("a", "c") and plan.dropped == ["b", "d"]
    assert_tp_groups_whole(new)


# (2) TP=2 with 8 ranks per node ------------------------------------------------------------


def test_tp2_on_8_rank_nodes_shrinks_by_four_replicas_per_node() -> None:
    plan = plan_restart(job("a b c d", tp=2), ["a", "b", "c", "d"], {"c"})
    new = placed(plan)
    assert (new.dp, new.world_size) == (12, 24)
    assert_tp_groups_whole(new)
    # Divisibility: dp 12 does not divide 16, so one more node goes (dp 8), from the tail.
    plan = plan_restart(job("a b c d", tp=2), ["a", "b", "c", "d"], {"c"}, dp_must_divide=16)
    new = placed(plan)
    assert new.dp == 8 and new.nodes == ("a", "b") and plan.dropped == ["c", "d"]
    assert_tp_groups_whole(new)


@pytest.mark.parametrize(("rpn", "tp"), [(8, 3), (8, 16), (2, 4)])
def test_a_tp_group_that_would_not_fit_whole_in_a_node_is_refused_at_the_layout(
    rpn: int, tp: int
) -> None:
    """A partial TP group cannot arise in a plan: the layout itself is refused, and nodes
    leave a plan whole, so every dp the planner picks keeps whole groups."""
    with pytest.raises(ValueError, match=f"tp={tp} must divide ranks_per_node={rpn}"):
        job("a b", rpn=rpn, tp=tp)


# (3) the elastic minimum ------------------------------------------------------------------


def test_min_dp_reached_exactly_is_a_valid_shrink() -> None:
    plan = plan_restart(job("a b c d", rpn=2, tp=1), ["a", "b", "c", "d"], {"d"}, min_dp=6)
    assert plan.kind == "shrink" and placed(plan).dp == 6


def test_min_dp_out_of_reach_refuses_naming_the_numbers() -> None:
    plan = plan_restart(job("a b c d", rpn=2, tp=1), ["a", "b", "c", "d"], {"c", "d"}, min_dp=6)
    assert plan.kind == "refused" and plan.placement is None
    assert plan.reason == (
        "job 'gpt' needs at least 3 healthy nodes (min_dp=6, tp=1, 2 ranks per node); "
        "2 available: a, b"
    )


def test_min_dp_above_the_jobs_size_says_the_cap_not_a_shortage() -> None:
    """min_dp above what the job's own size gives (a policy min_dp for bigger jobs) with
    spares on offer: the restart does not grow the job uninvited, and the refusal must not
    read "needs 4, 5 available" as the planner used to say."""
    pool = ["a", "b", "c", "d", "e"]
    plan = plan_restart(job("a b c", rpn=2, tp=1), pool, set(), min_dp=8)
    assert plan.kind == "refused"
    assert plan.reason == (
        "job 'gpt' needs at least 4 healthy nodes (min_dp=8, tp=1, 2 ranks per node) but a "
        "restart may use at most 3 (its size; more only by grow, up to original_nodes); "
        "5 available: a, b, c, d, e"
    )
    # Growing up to the original size is allowed to reach it.
    grown = plan_restart(
        job("a b c", rpn=2, tp=1), pool, set(), min_dp=8, grow=True, original_nodes=4
    )
    assert grown.kind == "grow" and placed(grown).nodes == ("a", "b", "c", "d")


# (4) several bad nodes at once --------------------------------------------------------------


def test_two_incidents_give_one_plan_without_either_node() -> None:
    one_spare = plan_restart(job("a b c d"), ["a", "b", "c", "d", "s"], {"b", "d"})
    new = placed(one_spare)
    assert one_spare.replaced == {"b": "s"} and one_spare.dropped == ["d"]
    assert new.nodes == ("a", "s", "c") and {"b", "d"}.isdisjoint(new.nodes)
    none_spare = plan_restart(job("a b c d"), ["a", "b", "c", "d"], {"b", "d"})
    assert placed(none_spare).nodes == ("a", "c") and none_spare.dropped == ["b", "d"]
    assert_tp_groups_whole(placed(none_spare))


# (5) spares that must never be picked, and a stable choice -----------------------------------


def test_spares_excluded_for_any_reason_are_never_chosen() -> None:
    """The engine folds isolated, cordoned, unhealthy, lost and failed-preflight nodes
    (and the culprit) into ``excluded``; the actuator leaves out nodes cordoned by others
    (an operator's reservation). Whatever the reason, an excluded spare is skipped even
    when listed first, and the first usable one in candidate order is taken."""
    pool = ["iso", "cordoned", "sick", "busy", "ok1", "ok2"]
    bad = {"b", "iso", "cordoned", "sick", "busy"}
    plan = plan_restart(job("a b"), pool, bad)
    assert plan.replaced == {"b": "ok1"} and placed(plan).nodes == ("a", "ok1")
    # Only excluded spares: shrink rather than use one.
    plan = plan_restart(job("a b"), ["iso", "sick"], {"b", "iso", "sick"})
    assert plan.kind == "shrink" and placed(plan).nodes == ("a",)


def test_the_spare_choice_is_deterministic_and_follows_candidate_order() -> None:
    args = (job("a b c"), ["z", "y", "x", "y"], {"b"})
    plans = {plan_restart(*args).reason for _ in range(5)}
    assert plans == {plan_restart(*args).reason}
    assert plan_restart(*args).replaced == {"b": "z"}
    # Set iteration order of ``excluded`` plays no part.
    assert plan_restart(job("a b c"), ["z", "y"], {"b", "z"}).replaced == {"b": "y"}


# (6) layouts the planner cannot express -----------------------------------------------------


def test_a_node_listed_twice_is_refused_at_the_layout_and_deduplicated_as_a_spare() -> None:
    with pytest.raises(ValueError, match="repeats a node"):
        job("a b a")
    plan = plan_restart(job("a b c"), ["s", "s", "t"], {"b", "c"})
    assert plan.replaced == {"b": "s", "c": "t"}


def test_a_placement_without_nodes_is_refused() -> None:
    """A placement has one ``ranks_per_node``, so a job whose nodes host different rank
    counts cannot be stated to the planner at all (describing it is the actuator's to
    refuse); a placement with no nodes is refused rather than planned as world size 0."""
    with pytest.raises(ValueError, match="has no nodes"):
        job("")


# (7) grow-back after a release -----------------------------------------------------------


def test_grow_back_after_release_returns_to_the_original_size_and_no_further() -> None:
    # d was isolated (job shrank to a b c); released, it is a candidate again, and so are
    # two more spares: the job grows to its first 4 nodes, not to 6.
    plan = plan_restart(
        job("a b c"), ["a", "b", "c", "d", "e", "f"], set(), grow=True, original_nodes=4
    )
    new = placed(plan)
    assert plan.kind == "grow" and new.nodes == ("a", "b", "c", "d") and plan.added == ["d"]
    assert new.dp == 4
    assert_tp_groups_whole(new)


def test_grow_never_shrinks_a_job_above_its_original_size() -> None:
    plan = plan_restart(job("a b c"), ["a", "b", "c", "d"], set(), grow=True, original_nodes=2)
    assert plan.kind == "same_size" and placed(plan).nodes == ("a", "b", "c")


# (8) a single-node job -------------------------------------------------------------------


@pytest.mark.parametrize(("rpn", "tp"), [(1, 1), (8, 8), (8, 1)])
def test_a_single_node_job_moves_to_a_spare_or_is_refused_never_shrunk_to_zero(
    rpn: int, tp: int
) -> None:
    moved = plan_restart(job("a", rpn=rpn, tp=tp), ["a", "s"], {"a"})
    assert moved.kind == "same_size" and placed(moved).nodes == ("s",)
    refused = plan_restart(job("a", rpn=rpn, tp=tp), ["a"], {"a"})
    assert refused.kind == "refused" and refused.placement is None
    assert refused.reason.startswith("job 'gpt' needs at least 1 healthy nodes (min_dp=1, ")
    assert refused.reason.endswith("; 0 available: none")


# (9) hostile inputs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_dp": 0}, "min_dp must be >= 1, got 0"),
        ({"min_dp": -2}, "min_dp must be >= 1, got -2"),
        ({"dp_must_divide": 0}, "dp_must_divide must be >= 1, got 0"),
        ({"dp_must_divide": -8}, "dp_must_divide must be >= 1, got -8"),
        ({"original_nodes": 0, "grow": True}, "original_nodes must be >= 1, got 0"),
    ],
)
def test_bad_counts_are_one_line_value_errors(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_restart(job("a b"), ["a", "b"], set(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rpn", "tp"), [(0, 1), (-8, 1), (8, 0), (8, -2)])
def test_zero_or_negative_layout_counts_say_so(rpn: int, tp: int) -> None:
    """Not "tp=1 must divide ranks_per_node=0", which is true of the numbers."""
    with pytest.raises(ValueError, match=f"ranks_per_node={rpn} and tp={tp} must both be >= 1"):
        job("a", rpn=rpn, tp=tp)


def test_a_bare_string_for_the_node_lists_is_refused() -> None:
    """``excluded="node-b"`` would be the set of its characters and keep the culprit."""
    cur = Placement(job="gpt", nodes=("node-a", "node-b"), ranks_per_node=1)
    with pytest.raises(TypeError, match="excluded must be a collection of node names"):
        plan_restart(cur, ["node-a", "node-b", "node-c"], "node-b")
    with pytest.raises(TypeError, match="candidates must be a collection of node names"):
        plan_restart(cur, "node-c", {"node-b"})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # A policy's largest min_dp (2**31 - 1): the need is said, at once.
        ({"min_dp": 2**31 - 1}, "needs at least 1073741824 healthy nodes (min_dp=2147483647"),
        ({"min_dp": 10**7}, "needs at least 5000000 healthy nodes"),
        # A prime global batch never splits over an even dp per node: no count at all.
        ({"dp_must_divide": 2**31 - 1}, "has no node count that satisfies"),
    ],
)
def test_huge_policy_numbers_refuse_at_once(kwargs: dict[str, int], expected: str) -> None:
    """The refusal used to count node counts up to the policy's numbers: 5 s of a blocked
    event loop for min_dp=10**7, tens of minutes for a prime global batch."""
    start = time.perf_counter()
    plan = plan_restart(job("a b", rpn=2, tp=1), ["a", "b"], {"b"}, **kwargs)  # type: ignore[arg-type]
    assert time.perf_counter() - start < 1.0
    assert plan.kind == "refused" and expected in plan.reason, plan.reason


@pytest.mark.parametrize(
    ("rpn", "tp", "min_dp", "batch"),
    [(1, 1, 33, 1155), (2, 1, 3, 12), (8, 2, 5, 48), (8, 8, 3, 64), (4, 2, 7, 2), (2, 1, 1, 7)],
)
def test_the_need_a_refusal_names_is_the_smallest_node_count_that_works(
    rpn: int, tp: int, min_dp: int, batch: int
) -> None:
    """The arithmetic the refusal uses agrees with trying every count."""
    cur = job("a", rpn=rpn, tp=tp)
    plan = plan_restart(cur, ["a"], {"a"}, min_dp=min_dp, dp_must_divide=batch)
    per = rpn // tp
    brute = [n for n in range(1, batch + 1) if n * per >= min_dp and batch % (n * per) == 0]
    if brute:
        assert f"needs at least {brute[0]} healthy nodes" in plan.reason, plan.reason
    else:
        assert "has no node count" in plan.reason, plan.reason


# (10) the circuit breaker and the quarantine budget on tiny fleets ----------------------------


@pytest.mark.parametrize("fleet", [1, 2, 3])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 0.99, 0.999999])
def test_the_breaker_never_lets_a_share_below_one_isolate_the_whole_fleet(
    fleet: int, fraction: float
) -> None:
    g = Guards(max_isolated_fraction=fraction)
    limit = breaker_limit(g, fleet)
    assert limit == math.floor(Fraction(fraction) * fleet + Fraction(1, 10**9))
    assert limit < fleet
    names = [f"n{i}" for i in range(fleet)]
    isolated: dict[str, float | None] = {}
    allowed = 0
    for name in names:
        if circuit_breaker(
            name, isolated_since=isolated, known_nodes=fleet, now_unix_s=100.0, guards=g
        ):
            break
        isolated[name] = 100.0
        allowed += 1
    assert allowed == limit < fleet


def test_a_share_of_one_is_the_operators_explicit_choice_to_allow_the_whole_fleet() -> None:
    g = Guards(max_isolated_fraction=1.0)
    assert [breaker_limit(g, n) for n in (1, 2, 3)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("fraction", "fleet", "limit"),
    [(0.1, 30, 3), (0.7, 10, 7), (0.29, 100, 29), (0.3, 10, 3), (0.25, 3, 0), (0.34, 3, 1)],
)
def test_the_breaker_limit_is_the_decimal_share_rounded_down(
    fraction: float, fleet: int, limit: int
) -> None:
    """Float products such as 0.29 * 100 = 28.999999999999996 still give 29."""
    assert breaker_limit(Guards(max_isolated_fraction=fraction), fleet) == limit


def test_released_isolations_count_on_a_two_node_fleet() -> None:
    g = Guards(max_isolated_fraction=0.5, isolation_window_s=3600.0)
    # n0 isolated by remediation ten minutes ago, released since: n1 would be the second.
    refused = circuit_breaker(
        "n1",
        isolated_since={"n0": None, "n1": None},
        known_nodes=2,
        now_unix_s=1000.0,
        guards=g,
        history=[("n0", 400.0)],
    )
    assert refused is not None and "would make 2 of 2 nodes isolated" in refused
    assert "counted though not isolated now: n0" in refused


def test_the_quarantine_budget_floor_of_one_is_held_by_the_breaker_in_front() -> None:
    """Documented trade-off: the quarantine budget allows at least one node, so on a
    one-node fleet it alone would take the whole fleet out; the policy's circuit breaker is
    checked first and, at any share below 1, refuses that isolation."""
    assert quarantine_limit(PartitionSettings(max_quarantine_share=0.1), 1) == 1
    refused = circuit_breaker(
        "n0", isolated_since={"n0": None}, known_nodes=1, now_unix_s=0.0, guards=Guards()
    )
    assert refused is not None and "1 of 1 nodes" in refused and "limit 25% = 0" in refused
