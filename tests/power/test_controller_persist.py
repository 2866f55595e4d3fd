"""The domain tree's rows: what goes into ``power_domains`` comes back as the same tree."""

from __future__ import annotations

from typing import Any

import pytest

from controller.db.models import PowerDomain
from controller.services.power.persist import from_rows, to_rows, validate
from power import ConfigError, Priority

TREE: dict[str, Any] = {
    "name": "dc1",
    "kind": "datacenter",
    "budget_w": 100_000,
    "policy": {"t2_frac": 0.93, "min_hold_s": 30},
    "children": [
        {
            "name": "row-b",
            "kind": "row",
            "budget_w": 9000,
            "children": [
                {
                    "name": "node-2",
                    "kind": "server",
                    "budget_w": 4200,
                    "children": [
                        {"name": "node-2-gpu1", "kind": "gpu", "budget_w": 400, "gpu_index": 1},
                        {"name": "node-2-gpu0", "kind": "gpu", "budget_w": 400, "gpu_index": 0},
                    ],
                },
                {"name": "node-1", "kind": "server", "budget_w": 4200},
            ],
        },
        {"name": "row-a", "kind": "row", "budget_w": 8000, "policy": {"knob": "power_limit"}},
    ],
}


def test_rows_round_trip_keeps_order_policy_and_priorities() -> None:
    rows = to_rows(TREE, {"node-1": Priority.LOW}, {"train-a": Priority.HIGH})
    assert [r["name"] for r in rows][:3] == ["dc1", "row-b", "node-2"]  # parents first
    gpu = next(r for r in rows if r["name"] == "node-2-gpu1")
    assert gpu["node_name"] == "node-2" and gpu["gpu_index"] == 1
    assert rows[0]["labels"]["job_priorities"] == {"train-a": "high"}  # on the root's row
    raw, priorities, jobs = from_rows([PowerDomain(**r) for r in reversed(rows)])
    assert raw == TREE
    assert priorities == {"node-1": Priority.LOW}
    assert jobs == {"train-a": Priority.HIGH}
    tree, _ = validate(raw)
    assert tree["row-a"].policy.knob.value == "power_limit"
    assert tree["node-2"].policy.t2_frac == 0.93


def test_empty_table_is_no_tree() -> None:
    assert from_rows([]) == (None, {}, {})


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "domains: must be a mapping"),
        ({"name": "r", "kind": "row"}, "domains.budget_w: required"),
        (
            {**TREE, "children": [{"name": "x", "kind": "row", "budget_w": 1, "colour": 1}]},
            "domains.children[0].colour: unknown key",
        ),
    ],
)
def test_validate_names_the_path(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(doc)
