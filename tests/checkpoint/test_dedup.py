"""Planning which replica writes each shared tensor (pure, plain data)."""

from __future__ import annotations

import torch

from checkpoint._dedup import Shared, plan_writers
from checkpoint.rules import ParallelLayout
from checkpoint.sharding import ShardingSpec
from tests import fresh_python


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


_SAVE_WITHOUT_DTENSORS = """
import sys, tempfile, torch
from checkpoint import CheckpointConfig, Checkpointer, ShardingSpec
from checkpoint.rules import ParallelLayout
spec = ShardingSpec([{"pattern": "*", "rule": "replicate"}], layout=ParallelLayout(dp=1))
with tempfile.TemporaryDirectory() as root:
    model = torch.nn.Linear(4, 4)
    with Checkpointer(CheckpointConfig(root=root, writer="thread"), sharding=spec) as ckpt:
        ckpt.save({"model": model}, step=1)
        ckpt.wait()
    assert Checkpointer(CheckpointConfig(root=root, writer="thread")).load(
        {"model": torch.nn.Linear(4, 4)}).step == 1
print("torch.distributed.tensor" in sys.modules)
"""


def test_a_save_without_dtensors_does_not_import_dtensor() -> None:
    """In a fresh interpreter (this one has DTensor loaded): a save whose tensors are all
    plain does not pay ~0.5 s of CPU per rank to import ``torch.distributed.tensor`` just
    to learn that none of them is a DTensor."""
    done = fresh_python.run(_SAVE_WITHOUT_DTENSORS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
