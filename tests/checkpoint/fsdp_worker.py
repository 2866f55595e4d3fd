"""Rank bodies for the FSDP2 / tensor-parallel test (real gloo, CPU device mesh).

Phase 1, world 2: an FSDP2 model (``fully_shard`` per layer and at the root) and a
tensor-parallel one (``parallelize_module``: column- then row-parallel, its last bias
replicated) train two Adam steps each and save through ``Checkpointer.save`` exactly as a
plain module does; rank 0 keeps their full (gathered) state as the reference. Phase 2,
world 3 (so 10 rows split 4/4/2: uneven): the FSDP2 checkpoint is loaded into the TP model
and the TP checkpoint into the FSDP2 model with ``checkpoint.reshard``, and every parameter
and Adam moment is compared bit for bit with the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from checkpoint import CheckpointConfig, Checkpointer, reshard
from checkpoint.sharding import ShardingSpec

#: Non-DTensor tensors (Adam's step counts) are the same on every rank.
SPEC_RULES = [{"pattern": "*", "rule": "replicate"}]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6))


def _fsdp(mesh: DeviceMesh) -> torch.nn.Module:
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp(mesh: DeviceMesh) -> torch.nn.Module:
    return parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
    }


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for index, per in opt.state_dict()["state"].items():
        out.update({f"optim/state/{index}/{n}": t for n, t in per.items()})
    return out


def _init(rank: int, world: int, init_file: str) -> DeviceMesh:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def save_rank(rank: int, roots: tuple[str, str], init_file: str, out_dir: str) -> None:
    mesh = _init(rank, 2, init_file)
    torch.manual_seed(1)  # the same data on every rank: TP needs it, FSDP2 accepts it
    batches = [torch.randn(4, 12) for _ in range(2)]
    for root, build in zip(roots, (_fsdp, _tp), strict=True):
        model = build(mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        engine = Checkpointer(
            CheckpointConfig(root=root, writer="thread", include_rng=False),
            rank=rank,
            world_size=2,
            sharding=ShardingSpec(SPEC_RULES),
        )
        engine.save({"model": model, "optim": opt}, step=2)
        engine.close()
        reference = _full(_flat(model, opt))
        if rank == 0:
            torch.save(reference, Path(out_dir, f"{Path(root).name}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def load_rank(rank: int, roots: tuple[str, str], init_file: str, out_dir: str) -> None:
    mesh = _init(rank, 3, init_file)
    for root, build in zip(roots, (_tp, _fsdp), strict=True):  # crossed over
        model = build(mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for p in model.parameters():  # Adam state to fill, without training
            p.grad = torch.zeros_like(p)
        opt.step()
        result = reshard(root, {"model": model, "optim": opt}, sharding=ShardingSpec(SPEC_RULES))
        assert result.step == 2
        want = torch.load(Path(out_dir, f"{Path(root).name}.pt"), weights_only=True)
        got = _full(_flat(model, opt))
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name, value in want.items():
            assert torch.equal(got[name], value), (rank, root, name)
    Path(out_dir, f"fsdp-ok-{rank}").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()
