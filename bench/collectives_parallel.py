"""Real FSDP2, DTensor and pipelining steps on gloo, and how many of their collectives the
wrapper saw next to what torch itself recorded (``collectives_seen_ratio``).

Shared by ``bench.collectives`` and ``tests/collectives/test_parallel.py``: each rank builds
the four workloads in turn (FSDP2 ``fully_shard`` on a ``dp`` mesh; DTensor redistribute, a
partial sum and a direct functional all_reduce on a ``tp`` mesh; a ``torch.compile``'d
function whose graph all_gathers, all_reduces and reduce_scatters; ``ScheduleGPipe`` over one
stage per rank), runs ``steps`` instrumented steps of each under the profiler, and returns
the wrapper's calls per step, its Flight Recorder entries and the profiler's ``c10d::``
operators per step. :func:`seen` turns that into ratios: Flight Recorder's collectives
(group, sequence number, op) for FSDP2, DTensor and the compiled graph, the profiler's
point-to-point operators for pipelining (gloo's Flight Recorder does not record P2P).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import collectives
from collectives import flight

SCENARIOS = ("fsdp2", "dtensor", "compiled", "pipeline")


def fsdp2(rank: int, world: int) -> Callable[[], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(data).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(0.1 * p.grad)
                p.grad = None

    return step


def dtensor(rank: int, world: int) -> Callable[[], None]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def step() -> None:
        d = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()]).to_local()
        total = (d * 2).sum()
        assert isinstance(total, DTensor)  # a DTensor op returns one: its sum is Partial
        total.full_tensor()
        reduced = funcol.all_reduce(torch.ones(4), "sum", mesh)
        funcol.wait_tensor(reduced)  # type: ignore[no-untyped-call]

    return step


COMPILE_BACKEND = os.environ.get("TG_COMPILE_BACKEND", "aot_eager")
"""``torch.compile`` backend of the ``compiled`` scenario. ``aot_eager`` by default: the
same AOTAutograd graph inductor starts from, run by torch's eager kernels, compiled in
about a second; ``inductor`` (its generated code calls ``all_reduce_`` in place) took 71 s
to compile a two-collective function for one rank on a shared 2-core machine."""


def compiled(rank: int, world: int) -> Callable[[], None]:
    """A ``torch.compile``'d step: a functional all_reduce of the gradient-like tensor and an
    FSDP2-like all_gather of a parameter shard, both inside one graph (``fullgraph``), and a
    reduce_scatter back, as FSDP2 would issue them if compiled."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None
    shard = torch.full((4,), float(rank + 1))

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        full = funcol.all_gather_tensor(w, 0, group)  # FSDP2's unshard
        y = funcol.all_reduce(x * full.sum(), "sum", group)
        out: torch.Tensor = funcol.reduce_scatter_tensor(y.repeat(world), "sum", 0, group)
        return out

    fn = torch.compile(body, backend=COMPILE_BACKEND, fullgraph=True)
    data = torch.randn(4, generator=torch.Generator().manual_seed(rank))
    fn(data, shard)  # compile outside the steps: the trace itself issues no collective

    def step() -> None:
        out = fn(data, shard)
        float(out.sum())  # use the result: its wait runs inside the step

    return step


def pipeline(rank: int, world: int) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(rank)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, _t: out.sum())

    def step() -> None:
        if rank == 0:
            schedule.step(torch.randn(4, 8))
        elif rank == world - 1:
            schedule.step(target=torch.randn(4, 8))
        else:
            schedule.step()

    return step


BUILDERS = {"fsdp2": fsdp2, "dtensor": dtensor, "compiled": compiled, "pipeline": pipeline}


def run(steps: int = 2) -> dict[str, Any]:
    """This rank's run of every scenario (needs ``init_process_group`` and ``instrument()``
    done, Flight Recorder on)."""
    session = collectives.current()
    assert session is not None, "call collectives.instrument() first"
    rank, world = dist.get_rank(), dist.get_world_size()
    windows: dict[int, tuple[int, int]] = {}
    profiled: dict[int, dict[str, int]] = {}
    scenarios: dict[str, list[int]] = {}
    i = 0
    for name in SCENARIOS:
        work = BUILDERS[name](rank, world)
        scenarios[name] = []
        for _ in range(steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.time_ns()
                with collectives.step(i):
                    work()
                windows[i] = (t0, time.time_ns())
            profiled[i] = dict(flight.profiler_ops(prof.events()))
            scenarios[name].append(i)
            i += 1
    dist.barrier()
    rec = session.recorder
    deadline = time.monotonic() + 10
    while rec._inflight and time.monotonic() < deadline:  # functional calls close at wait
        time.sleep(0.01)
    names = dict(rec.group_names)
    return {
        "calls": [
            {"step": r.step, "group": names.get(r.group, r.group), "seq": r.seq, "op": r.op}
            for r in rec.history
            if r.step is not None
        ],
        "windows": windows,
        "scenarios": scenarios,
        "entries": flight.dump()["entries"],
        "profiled": profiled,
        "inflight": len(rec._inflight),
        "roles": [
            {k: s[k] for k in ("step", "role", "pp_stage", "dp_rank", "tp_rank", "group_ranks")}
            for s in (x.model_dump() for x in session.outbox.steps.items)
        ],
    }


def only(res: dict[str, Any], scenario: str) -> dict[str, Any]:
    """``res`` restricted to one scenario's steps (keys may be str after a JSON round trip)."""
    steps = set(res["scenarios"][scenario])
    return {
        **res,
        "calls": [c for c in res["calls"] if c["step"] in steps],
        "windows": {int(k): v for k, v in res["windows"].items() if int(k) in steps},
        "profiled": {int(k): v for k, v in res["profiled"].items() if int(k) in steps},
        "roles": [r for r in res["roles"] if r["step"] in steps],
    }


def seen(res: dict[str, Any], scenario: str) -> flight.Comparison:
    """The wrapper against torch's own record, for one scenario of one rank's run."""
    part = only(res, scenario)
    if scenario == "pipeline":
        total = flight.Comparison()
        for step, theirs in part["profiled"].items():
            ours = Counter(flight.family(c["op"]) for c in part["calls"] if c["step"] == step)
            cmp = flight.compare_counts(ours, Counter(theirs))
            total.listed += cmp.listed
            total.seen += cmp.seen
            total.missing += [{"step": step, **m} for m in cmp.missing]
        return total
    calls = [flight.Call(c["step"], c["group"], c["seq"], c["op"]) for c in part["calls"]]
    windows = {k: (v[0], v[1]) for k, v in part["windows"].items()}
    return flight.compare(calls, part["entries"], windows)


__all__ = ["BUILDERS", "SCENARIOS", "only", "run", "seen"]
