"""Rank bodies for the multi-process (gloo) universal-checkpoint test."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from checkpoint import CheckpointConfig, Checkpointer, reshard
from checkpoint.rules import ParallelLayout
from tests.checkpoint.megatron import full_state, ln_mean, rank_state

#: Modules the test fork server imports once, so that its children start in milliseconds.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "checkpoint._engine",
    "checkpoint._reshard",
    "tests.checkpoint.crash_trainer",
    "tests.checkpoint.dist_worker",
]


def dtensor_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"dt/w": torch.randn(8, 6, generator=g), "dt/b": torch.randn(8, generator=g)}


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def save_rank(rank: int, root: str, init_file: str) -> None:
    """TP=2 x DP=2: Megatron-style plain shards + ZeRO-1 moments + two DTensors."""
    # DTensor's package (~0.5 s of CPU: it pulls in sympy) is imported here, in the ranks
    # (the fork server preloads it), not by every pytest worker collecting the tests.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, 4, init_file)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layout = ParallelLayout(tp=2, tp_rank=rank % 2, dp=2, dp_rank=rank // 2)
    state, spec = rank_state(full_state(), layout, pad_rows=6)
    dfull = dtensor_full()
    state["dt/w"] = distribute_tensor(dfull["dt/w"], mesh, [Replicate(), Shard(0)])
    state["dt/b"] = distribute_tensor(dfull["dt/b"], mesh, [Shard(0), Replicate()])
    engine = Checkpointer(
        CheckpointConfig(root=root, writer="process"),
        rank=rank,
        world_size=4,
        layout={"tp": 2, "dp": 2},
        sharding=spec,
    )
    engine.save(state, step=5)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


def load_rank(rank: int, root: str, init_file: str, out_dir: str) -> None:
    """TP=1 x DP=3, DTensors resharded along the other dimension onto a 3-rank mesh."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, 3, init_file)
    mesh = init_device_mesh("cpu", (3,))
    full = full_state()
    expected, spec = rank_state(full, ParallelLayout(tp=1, dp=3, dp_rank=rank), pad_rows=12)
    targets: dict[str, torch.Tensor] = {
        k: torch.full_like(v, float("nan")) for k, v in expected.items()
    }
    dfull = dtensor_full()
    targets["dt/w"] = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])
    targets["dt/b"] = distribute_tensor(torch.zeros(8), mesh, [Replicate()])
    result = reshard(root, targets, sharding=spec)
    assert result.step == 5
    for name, value in expected.items():
        want = ln_mean(full, 4) if name == "model/ln.weight" else value
        assert torch.equal(targets[name], want), (rank, name)
    for name in ("dt/w", "dt/b"):
        assert torch.equal(targets[name].full_tensor(), dfull[name]), (rank, name)
    Path(out_dir, f"ok-{rank}").write_text(str(result.bytes_read))
    dist.barrier()
    dist.destroy_process_group()


def _dp_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def dp4_rank(rank: int, roots: tuple[str, str], init_file: str, out_dir: str) -> None:
    """DP=4 replicas (gradients all-reduced, as DDP does) save with and without dedup; every
    rank then loads the deduplicated checkpoint into a fresh model and compares bit for bit."""
    from checkpoint import load
    from checkpoint.sharding import ShardingSpec

    _init(rank, 4, init_file)
    model, opt = _dp_model(0)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= 4
    opt.step()
    spec = ShardingSpec(
        [{"pattern": "*", "rule": "replicate"}], layout=ParallelLayout(dp=4, dp_rank=rank)
    )
    for root, dedup in zip(roots, (True, False), strict=True):
        engine = Checkpointer(
            CheckpointConfig(root=root, writer="thread", dedup_replicas=dedup),
            rank=rank,
            world_size=4,
            layout={"dp": 4},
            sharding=spec,
        )
        engine.save({"model": model, "optim": opt}, step=1)
        engine.close()
        dist.barrier()
    fresh, fresh_opt = _dp_model(1)
    load(roots[0], {"model": fresh, "optim": fresh_opt}, rank=rank)
    for (name, want), got in zip(
        model.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(want, got), (rank, name)
    want_opt, got_opt = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for index, per_param in want_opt.items():
        for key, value in per_param.items():
            assert torch.equal(value, got_opt[index][key]), (rank, index, key)
    Path(out_dir, f"dp-ok-{rank}").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()
