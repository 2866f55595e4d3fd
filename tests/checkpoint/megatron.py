"""A Megatron-style sharded toy state used by the universal-checkpoint tests.

The shards are cut here with plain tensor slicing, independently of checkpoint.sharding,
so the tests compare the package against a second implementation, not against itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.rules import ParallelLayout
from checkpoint.sharding import ShardingSpec, ZeroPartition

VOCAB, HIDDEN, PADDED_PER_TP = 10, 4, 6  # vocabulary padded to 12 rows for TP=2

RULES = [
    {"pattern": "*emb.weight", "rule": "vocab", "size": VOCAB},
    {"pattern": "*qkv.weight", "rule": "fused", "dim": 0, "parts": [4, 4, 4]},
    {"pattern": "*out.weight", "rule": "shard", "dim": 1},
    {"pattern": "*out.bias", "rule": "replicate"},
    {"pattern": "*ln.weight", "rule": "average"},
]
ZERO_PARAMS = ["qkv.weight", "out.weight", "out.bias"]
MOMENTS = ["exp_avg", "exp_avg_sq"]


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "model/emb.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model/qkv.weight": torch.randn(12, HIDDEN, generator=g),
        "model/out.weight": torch.randn(HIDDEN, 6, generator=g),
        "model/out.bias": torch.randn(HIDDEN, generator=g),
        "model/ln.weight": torch.randn(HIDDEN, generator=g),
    }
    for moment in MOMENTS:
        for param in ZERO_PARAMS:
            out[f"optim/{moment}/{param}"] = torch.randn(out[f"model/{param}"].shape, generator=g)
    return out


def tp_shard(name: str, full: torch.Tensor, tp: int, r: int, pad_rows: int) -> torch.Tensor:
    if name.endswith("emb.weight"):
        padded = torch.cat([full, torch.zeros(pad_rows * tp - VOCAB, HIDDEN)])
        return padded.chunk(tp)[r].clone()
    if name.endswith("qkv.weight"):
        return torch.cat([part.chunk(tp)[r] for part in full.split(4)]).clone()
    if name.endswith("out.weight"):
        return full.chunk(tp, dim=1)[r].clone()
    return full.clone()


def rank_state(
    full: dict[str, torch.Tensor], layout: ParallelLayout, pad_rows: int
) -> tuple[dict[str, torch.Tensor], ShardingSpec]:
    """This rank's tensors (ZeRO-1 moments as flat slices) and the spec describing them."""
    tp, r = layout.tp, layout.tp_rank
    state = {k: tp_shard(k, v, tp, r, pad_rows) for k, v in full.items() if k.startswith("model/")}
    state["model/ln.weight"] = full["model/ln.weight"] + (layout.dp_rank + r * layout.dp)
    params = tuple((p, tuple(state[f"model/{p}"].shape)) for p in ZERO_PARAMS)
    zero = ZeroPartition(
        prefixes=tuple(f"optim/{m}/" for m in MOMENTS),
        params=params,
        dp=layout.dp,
        dp_rank=layout.dp_rank,
    )
    for moment in MOMENTS:
        flat = torch.cat(
            [
                tp_shard(p, full[f"optim/{moment}/{p}"], tp, r, pad_rows).reshape(-1)
                for p in ZERO_PARAMS
            ]
        )
        size = -(-flat.numel() // layout.dp)
        mine = flat[layout.dp_rank * size : (layout.dp_rank + 1) * size].clone()
        for param, view in zero.split(mine).items():
            state[f"optim/{moment}/{param}"] = view
    return state, ShardingSpec(RULES, layout=layout, zero=zero)


def ln_mean(full: dict[str, torch.Tensor], world: int) -> torch.Tensor:
    """The ``average`` rule's expected result: rank copies are ln + 0, ln + 1, ...,
    summed in rank order and divided (the loader's order, so the result is bit-exact)."""
    acc = torch.zeros_like(full["model/ln.weight"])
    for rank in range(world):
        acc = acc + (full["model/ln.weight"] + rank)
    return acc / world


def layouts(tp: int, dp: int) -> list[ParallelLayout]:
    """Rank r of a TP x DP job: TP varies fastest, as in Megatron."""
    return [ParallelLayout(tp=tp, tp_rank=r % tp, dp=dp, dp_rank=r // tp) for r in range(tp * dp)]


def save_sharded(
    root: Path, tp: int, dp: int, full: dict[str, torch.Tensor], pad: int, *, step: int = 10
) -> None:
    """Every rank of a TP x DP job saves ``step`` with its own engine (writer threads)."""
    engines = []
    for rank, layout in enumerate(layouts(tp, dp)):
        state, spec = rank_state(full, layout, pad)
        engine = Checkpointer(
            CheckpointConfig(root=root, writer="thread"),
            rank=rank,
            world_size=tp * dp,
            layout={"tp": tp, "dp": dp},
            sharding=spec,
        )
        engine.save(state, step=step)
        engines.append(engine)
    for engine in reversed(engines):  # rank 0 commits once the others are durable
        engine.close()
