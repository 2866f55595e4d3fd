"""One rank of a real FSDP2 / DTensor / pipelining job on gloo (launched by test_parallel.py).

Usage: ``python parallel_worker.py all <out_dir>``: FSDP2 at steps 0-1, DTensor at 2-3,
pipelining at 4-5 (one launch: starting torch costs more than the runs); writes
``rank<N>.json`` with the wrapper's calls per step, this rank's Flight Recorder entries and
the profiler's ``c10d::`` operators per step, and the role fields of its step summaries.
Flight Recorder is on (``TORCH_FR_BUFFER_SIZE`` from the launcher) before the process group
exists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import collectives
from collectives import flight

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = 2


def fsdp2() -> Callable[[int], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(RANK))

    def step(_: int) -> None:
        loss = model(data).sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad
                p.grad = None

    return step


def dtensor() -> Callable[[int], None]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def step(_: int) -> None:
        d = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()]).to_local()
        (d * 2).sum().full_tensor()
        funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", mesh))  # direct funcol too

    return step


def pipeline() -> Callable[[int], None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(RANK)
    stage = PipelineStage(torch.nn.Linear(8, 8), RANK, WORLD, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, _t: out.sum())

    def step(_: int) -> None:
        if RANK == 0:
            schedule.step(torch.randn(4, 8))
        elif RANK == WORLD - 1:
            schedule.step(target=torch.randn(4, 8))
        else:
            schedule.step()

    return step


def main() -> None:
    out = Path(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=RANK, world_size=WORLD
    )
    session = collectives.instrument()
    windows: dict[int, tuple[int, int]] = {}
    profiled: dict[int, Counter[str]] = {}
    scenarios: dict[str, list[int]] = {}
    i = 0
    for name, build in (("fsdp2", fsdp2), ("dtensor", dtensor), ("pipeline", pipeline)):
        run = build()
        scenarios[name] = []
        for _ in range(STEPS):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.time_ns()
                with collectives.step(i):
                    run(i)
                windows[i] = (t0, time.time_ns())
            profiled[i] = flight.profiler_ops(prof.events())
            scenarios[name].append(i)
            i += 1
    dist.barrier()
    rec = session.recorder
    deadline = time.monotonic() + 10
    while rec._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    names = dict(rec.group_names)
    calls = [
        {"step": r.step, "group": names.get(r.group, r.group), "seq": r.seq, "op": r.op}
        for r in rec.history
        if r.step is not None
    ]
    summaries = [s.model_dump() for s in session.outbox.steps.items]
    result: dict[str, Any] = {
        "calls": calls,
        "windows": windows,
        "scenarios": scenarios,
        "entries": flight.dump()["entries"],
        "profiled": {i: dict(c) for i, c in profiled.items()},
        "roles": [
            {k: s[k] for k in ("step", "role", "pp_stage", "dp_rank", "tp_rank", "group_ranks")}
            for s in summaries
        ],
        "inflight": len(rec._inflight),
    }
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    collectives.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
