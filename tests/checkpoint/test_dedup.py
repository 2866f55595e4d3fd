"""Planning which replica writes each shared tensor (pure, plain data)."""

from __future__ import annotations

import torch

from checkpoint._dedup import Shared, plan_writers
from checkpoint.rules import ParallelLayout
from checkpoint.sharding import ShardingSpec


def test_each_tensor_gets_one_writer_balanced_by_bytes() -> None:
    group = (1, 3, 5, 7)
    items = [Shared(f"t{i}", 100 + i, group) for i in range(12)] + [Shared("big", 1000, group)]
    plan = plan_writers(items)
    assert set(plan) == {i.name for i in items} and set(plan.values()) <= set(group)
    load = {r: sum(i.nbytes for i in items if plan[i.name] == r) for r in group}
    assert max(load.values()) - min(load.values()) <= 1000  # within one tensor of even
    assert plan == plan_writers(list(reversed(items)))  # every member computes the same


def test_groups_are_planned_apart() -> None:
    plan = plan_writers([Shared("a", 8, (0, 2)), Shared("b", 8, (1, 3)), Shared("c", 4, (0, 2))])
    assert plan["a"] in (0, 2) and plan["b"] in (1, 3) and plan["c"] != plan["a"]


def test_replicas_are_the_dp_peers_except_zero_average_and_rng() -> None:
    spec = ShardingSpec(
        [{"pattern": "*norm*", "rule": "average"}, {"pattern": "*", "rule": "shard", "dim": 0}],
        layout=ParallelLayout(tp=2, tp_rank=1, dp=3, dp_rank=2),
    )
    t = torch.zeros(2)
    assert spec.replicas("model/fc.weight", t) == (1, 3, 5)  # TP fastest, then DP
    assert spec.replicas("model/norm.weight", t) == ()
    assert spec.replicas("__rng__/torch", t) == ()
