"""Restart planning: named cases as a table, invariants with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.actuators.base import Placement
from controller.logic.remediation.planner import plan_restart


def placement(nodes: str, rpn: int = 2, tp: int = 1, generation: int = 3) -> Placement:
    return Placement(
        job="gpt", nodes=tuple(nodes.split()), ranks_per_node=rpn, tp=tp, generation=generation
    )


# (current nodes, rpn, tp, candidates, excluded, kwargs) -> (kind, new nodes, replaced, dropped)
CASES = {
    "spare replaces the culprit in its slot": (
        ("a b c", 2, 1, "a b c d e", "b", {}),
        ("same_size", "a d c", {"b": "d"}, []),
    ),
    "spares taken in candidate order, excluded spares skipped": (
        ("a b c", 2, 1, "x e d", "a c x", {}),
        ("same_size", "e b d", {"a": "e", "c": "d"}, []),
    ),
    "no spare: shrink, last node moves into the hole": (
        ("a b c d", 2, 1, "a b c d", "b", {}),
        ("shrink", "a d c", {}, ["b"]),
    ),
    "shrink further until dp divides the global batch": (
        ("a b c d", 2, 1, "a b c d", "b", {"dp_must_divide": 16}),
        ("shrink", "a c", {}, ["b", "d"]),
    ),
    "one spare for two culprits: replace one, drop the other": (
        ("a b c d", 1, 1, "a b c d s", "a c", {}),
        ("shrink", "s b d", {"a": "s"}, ["c"]),
    ),
    "nothing excluded: same nodes, next generation": (
        ("a b", 4, 2, "a b c", "", {}),
        ("same_size", "a b", {}, []),
    ),
    "grow back to the original size": (
        ("a c", 2, 1, "a b c d", "", {"grow": True, "original_nodes": 4}),
        ("grow", "a c b d", {}, []),
    ),
    "grow only as far as dp divides": (
        ("a", 2, 1, "a b c d", "", {"grow": True, "original_nodes": 4, "dp_must_divide": 4}),
        ("grow", "a b", {}, []),
    ),
    "grow without the flag does nothing": (
        ("a c", 2, 1, "a b c d", "", {"original_nodes": 4}),
        ("same_size", "a c", {}, []),
    ),
    "replace and grow in one plan": (
        ("a b", 2, 1, "a b c d", "b", {"grow": True, "original_nodes": 3}),
        ("grow", "a c d", {"b": "c"}, []),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_table(name: str) -> None:
    (nodes, rpn, tp, cands, excl, kwargs), (kind, new, replaced, dropped) = CASES[name]
    plan = plan_restart(
        placement(nodes, rpn, tp), cands.split(), set(excl.split()), resume_step=40, **kwargs
    )
    assert plan.kind == kind, plan.reason
    assert plan.placement is not None
    assert plan.placement.nodes == tuple(new.split())
    assert plan.replaced == replaced
    assert plan.dropped == dropped
    assert plan.placement.generation == 4
    assert plan.placement.resume_step == 40
    assert plan.kind in plan.reason


def test_refused_with_min_dp_names_the_need() -> None:
    plan = plan_restart(placement("a b c"), ["a", "b", "c"], {"a", "b"}, min_dp=4)
    assert plan.kind == "refused" and plan.placement is None
    assert plan.reason == (
        "job 'gpt' needs at least 2 healthy nodes (min_dp=4, tp=1, 2 ranks per node); "
        "1 available: c"
    )


def test_refused_when_no_dp_divides_the_batch() -> None:
    # 4 ranks per node with tp=1 gives dp in multiples of 4; a batch of 6 never splits.
    plan = plan_restart(placement("a b", rpn=4), ["a", "b"], set(), dp_must_divide=6)
    assert plan.kind == "refused"
    assert "no node count" in plan.reason and "dp dividing 6" in plan.reason


def test_refused_when_every_node_is_excluded() -> None:
    plan = plan_restart(placement("a b"), ["a", "b"], {"a", "b"})
    assert plan.kind == "refused"
    assert plan.reason.endswith("0 available: none")


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="min_dp must be >= 1"):
        plan_restart(placement("a"), [], set(), min_dp=0)
    with pytest.raises(ValueError, match="dp_must_divide"):
        plan_restart(placement("a"), [], set(), dp_must_divide=0)


def test_as_dict_is_json_ready() -> None:
    plan = plan_restart(placement("a b"), ["a", "b", "c"], {"a"}, resume_step=7)
    d = plan.as_dict()
    assert d["placement"]["nodes"] == ["c", "b"]
    assert d["placement"]["dp"] == 4 and d["placement"]["resume_step"] == 7
    assert d["replaced"] == {"a": "c"}


NAMES = [f"n{i}" for i in range(12)]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Placement, list[str], set[str], dict[str, object]]:
    tp = draw(st.sampled_from([1, 2, 4]))
    rpn = tp * draw(st.sampled_from([1, 2]))
    current_nodes = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True))
    cands = draw(st.permutations(NAMES))[: draw(st.integers(0, len(NAMES)))]
    excluded = set(draw(st.lists(st.sampled_from(NAMES), max_size=6)))
    kwargs: dict[str, object] = {
        "min_dp": draw(st.integers(1, 8)),
        "dp_must_divide": draw(st.sampled_from([None, 8, 12, 16, 48])),
        "grow": draw(st.booleans()),
        "original_nodes": draw(st.sampled_from([None, 4, 8])),
    }
    cur = Placement(job="j", nodes=tuple(current_nodes), ranks_per_node=rpn, tp=tp)
    return cur, list(cands), excluded, kwargs


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_plan_invariants(
    scenario: tuple[Placement, list[str], set[str], dict[str, object]],
) -> None:
    cur, cands, excluded, kwargs = scenario
    plan = plan_restart(cur, cands, excluded, **kwargs)  # type: ignore[arg-type]
    if plan.kind == "refused":
        assert plan.placement is None and plan.reason.startswith("job 'j'")
        return
    new = plan.placement
    assert new is not None
    allowed = (set(cur.nodes) | set(cands)) - excluded
    assert set(new.nodes) <= allowed, "an excluded or unknown node was planned"
    assert len(set(new.nodes)) == len(new.nodes)
    assert new.ranks_per_node % new.tp == 0 and new.tp == cur.tp
    assert new.dp >= kwargs["min_dp"]  # type: ignore[operator]
    if kwargs["dp_must_divide"] is not None:
        assert kwargs["dp_must_divide"] % new.dp == 0  # type: ignore[operator]
    assert new.generation == cur.generation + 1
    # Most nodes stay in place: a healthy node kept in the plan moves only if its old
    # position is past the new end (it filled a hole).
    for i, node in enumerate(cur.nodes):
        if node in new.nodes and i < len(new.nodes):
            assert new.nodes[i] == node, f"{node} moved from slot {i}"
    # Every node of the current placement is kept, replaced or dropped, exactly once.
    gone = set(plan.replaced) | set(plan.dropped)
    assert gone.isdisjoint(new.nodes)
    assert (set(cur.nodes) - gone) <= set(new.nodes)
    assert len(new.nodes) == len(cur.nodes) - len(plan.dropped) + len(plan.added)
    expected = {"same_size": 0, "shrink": -1, "grow": 1}[plan.kind]
    diff = len(new.nodes) - len(cur.nodes)
    assert (diff > 0) - (diff < 0) == expected
