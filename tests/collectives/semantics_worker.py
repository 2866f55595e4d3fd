"""One rank of the transparency sweep (launched by test_semantics_sweep.py, world 2).

Usage: ``python semantics_worker.py sweep <out_dir>``; writes ``rank<N>.json``.

Every case runs twice in the same process on real gloo: once on plain torch.distributed
(before ``instrument()``) and once instrumented, and each run is reduced to a fingerprint
(return values and their types, ``isinstance(..., dist.Work)``, what ``wait()``,
``is_completed()`` and ``get_future()`` give, tensors written in place, exceptions' types
and messages, warnings, whether a tensor outlived the call). The test compares the two.
Then ``uninstrument()`` must leave every function and class attribute of torch.distributed
as it found it, and last a peer dies: rank 1 exits, rank 0's next collective must fail the
same way with and without the wrapper.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import collectives
from collectives.timed_work import TimedWork

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PEER = 1 - RANK


def world() -> Any:
    """The world group (``dist.group.WORLD``, typed Optional by torch)."""
    return dist.group.WORLD


def f(n: int, base: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 10 * (RANK + 1) + base


def fp(value: Any) -> Any:
    """A JSON fingerprint of what a call gave the job."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            value = value.to_dense()
        return {"tensor": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, list | tuple):
        return [fp(v) for v in value]
    if isinstance(value, dict):
        return {str(k): fp(v) for k, v in value.items()}
    if isinstance(value, dist.Work):
        return {"work": True}
    return {"type": type(value).__name__, "is_work": isinstance(value, dist.Work)}


def work_fp(work: Any, *outputs: torch.Tensor, future: bool = True) -> dict[str, Any]:
    """What an async handle does: its type, wait(), is_completed(), its future's value."""
    out: dict[str, Any] = {"is_work": isinstance(work, dist.Work), "none": work is None}
    if work is None:
        return out
    out["wait"] = fp(work.wait())
    out["completed"] = bool(work.is_completed())
    out["outputs"] = [fp(t) for t in outputs]
    if not future:  # gloo's point-to-point works: no future to ask for
        return out
    try:
        fut = work.get_future()
    except Exception as exc:
        out["future"] = err_fp(exc)
        return out
    out["future"] = fp(fut.wait())
    out["future_done"] = bool(fut.done())
    return out


def err_fp(exc: BaseException, message: bool = True) -> dict[str, Any]:
    text = str(exc).splitlines()[0] if str(exc) else ""
    text = re.sub(r"\d+", "N", text)[:160]  # group names, ports, times
    return {"raised": type(exc).__name__, **({"msg": text} if message else {})}


def session_records() -> int:
    session = collectives.current()
    return 0 if session is None else len(session.recorder.history) + len(session.recorder._inflight)


# ---------------------------------------------------------------------- the cases


class Ctx:
    def __init__(self) -> None:
        self.member = dist.new_group([0])  # rank 1 is not in it
        self.pair = dist.new_group([0, 1])
        self.sub, _ = dist.new_subgroups(group_size=1)  # type: ignore[no-untyped-call]
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        self.mesh_group = self.mesh.get_group("dp")
        self.lonely: dict[str, Any] = {
            mode: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1.5))
            for mode in ("plain", "instr")
        }
        self.mode = "plain"
        # torch warns once per process at the first sparse tensor: not in a compared case
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.ones(1), (1,))


def c_all_reduce_sync(ctx: Ctx) -> Any:
    t = f(4)
    return {"ret": fp(dist.all_reduce(t)), "t": fp(t)}


def c_all_reduce_positional(ctx: Ctx) -> Any:
    t = f(4)
    w = dist.all_reduce(t, dist.ReduceOp.MAX, None, True)
    return work_fp(w, t)


def c_all_reduce_async_kw(ctx: Ctx) -> Any:
    t = f(3)
    w = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
    return work_fp(w, t)


def c_all_reduce_future_first(ctx: Ctx) -> Any:
    """The future before any wait (DDP's comm hooks), chained with then()."""
    t = f(3)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future().then(lambda fu: fu.value()[0] * 2)
    value = fp(fut.wait())
    return {"chained": value, "wait": fp(w.wait()), "t": fp(t)}


def c_all_reduce_group_none_vs_world(ctx: Ctx) -> Any:
    a, b, c = f(2), f(2), f(2)
    return [
        fp(dist.all_reduce(a, group=None)),
        fp(dist.all_reduce(b, group=dist.group.WORLD)),
        fp(dist.all_reduce(c, group=dist.GroupMember.WORLD, async_op=False)),
        fp([a, b, c]),
    ]


def c_all_reduce_dtypes(ctx: Ctx) -> Any:
    out = []
    for dtype in (torch.int64, torch.float16, torch.bfloat16, torch.complex64, torch.bool):
        t = (torch.arange(4) + RANK).to(dtype)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if dtype is torch.bool else dist.ReduceOp.SUM)
        out.append(fp(t.to(torch.complex64).real if dtype is torch.complex64 else t))
    return out


def c_all_reduce_sparse(ctx: Ctx) -> Any:
    """gloo all-reduces sparse COO tensors (DDP with sparse embedding gradients)."""
    s = torch.sparse_coo_tensor(
        torch.tensor([[RANK, 2 + RANK]]), torch.tensor([1.0 + RANK, 2.0]), (4,)
    )
    ret = dist.all_reduce(s)
    big = torch.sparse_coo_tensor(torch.arange(0, 600, 2)[None], torch.ones(300), (600,))
    dist.all_reduce(big)  # over the NaN/Inf check's size threshold
    return {"ret": fp(ret), "t": fp(s), "big": float(big.to_dense().sum())}


def c_all_reduce_empty(ctx: Ctx) -> Any:
    t = torch.empty(0)
    return {"ret": fp(dist.all_reduce(t)), "t": fp(t)}


def c_broadcast(ctx: Ctx) -> Any:
    a, b = f(3), f(5)
    r1 = dist.broadcast(a, src=1)
    w = dist.broadcast(b, 1, None, True)
    return {"sync": fp(r1), "a": fp(a), "async": work_fp(w, b)}


def c_broadcast_group_src(ctx: Ctx) -> Any:
    a = f(3)
    return [fp(dist.broadcast(a, group=ctx.pair, group_src=1)), fp(a)]


def c_all_gather(ctx: Ctx) -> Any:
    out = [torch.empty(3) for _ in range(WORLD)]
    r = dist.all_gather(out, f(3))
    out2 = [torch.empty(2) for _ in range(WORLD)]
    w = dist.all_gather(out2, f(2), async_op=True)
    return {"sync": fp(r), "out": fp(out), "async": work_fp(w, *out2)}


def c_all_gather_into_tensor(ctx: Ctx) -> Any:
    out = torch.empty(3 * WORLD)
    r = dist.all_gather_into_tensor(out, f(3))
    out2 = torch.empty(WORLD * 2)
    w = dist.all_gather_into_tensor(out2, f(2), async_op=True)
    return {"sync": fp(r), "out": fp(out), "async": work_fp(w, out2)}


def c_reduce_scatter_tensor(ctx: Ctx) -> Any:
    out = torch.empty(2)
    r = dist.reduce_scatter_tensor(out, f(2 * WORLD))
    out2 = torch.empty(3)
    w = dist.reduce_scatter_tensor(out2, f(3 * WORLD), dist.ReduceOp.MAX, None, True)
    return {"sync": fp(r), "out": fp(out), "async": work_fp(w, out2)}


def c_reduce_scatter_list(ctx: Ctx) -> Any:
    out = torch.empty(2)
    r = dist.reduce_scatter(out, [f(2, i) for i in range(WORLD)])
    return {"sync": fp(r), "out": fp(out)}


def c_all_to_all_single_uneven(ctx: Ctx) -> Any:
    splits = {0: [1, 2], 1: [3, 1]}
    in_split = splits[RANK]
    out_split = [splits[s][RANK] for s in range(WORLD)]
    inp = f(sum(in_split))
    out = torch.full((sum(out_split),), -1.0)
    r = dist.all_to_all_single(out, inp, out_split, in_split)
    out2 = torch.full((sum(out_split),), -1.0)
    w = dist.all_to_all_single(
        out2, inp, output_split_sizes=out_split, input_split_sizes=in_split, async_op=True
    )
    even = torch.empty(2 * WORLD)
    dist.all_to_all_single(even, f(2 * WORLD))
    return {"sync": fp(r), "out": fp(out), "async": work_fp(w, out2), "even": fp(even)}


def c_all_to_all_list(ctx: Ctx) -> Any:
    outs = [torch.empty(2) for _ in range(WORLD)]
    r = dist.all_to_all(outs, [f(2, i) for i in range(WORLD)])
    return {"ret": fp(r), "out": fp(outs)}


def c_reduce_gather_scatter(ctx: Ctx) -> Any:
    t = f(3)
    r1 = dist.reduce(t, dst=0)
    gathered = [torch.empty(2) for _ in range(WORLD)] if RANK == 0 else None
    r2 = dist.gather(f(2), gathered, dst=0)
    out = torch.empty(2)
    r3 = dist.scatter(out, [f(2, i) for i in range(WORLD)] if RANK == 1 else None, src=1)
    w = dist.reduce(f(2), 1, dist.ReduceOp.SUM, None, True)
    return {
        "reduce": fp(r1),
        "t": fp(t) if RANK == 0 else None,  # non-dst contents are unspecified
        "gather": fp(r2),
        "gathered": fp(gathered),
        "scatter": fp(r3),
        "out": fp(out),
        "async_reduce": {"is_work": isinstance(w, dist.Work), "wait": fp(w.wait())},
    }


def c_object_collectives(ctx: Ctx) -> Any:
    objs: list[Any] = [{"a": RANK}, "x" * (RANK + 1), None]
    r1 = dist.broadcast_object_list(objs, src=1)
    gathered: list[Any] = [None] * WORLD
    r2 = dist.all_gather_object(gathered, {"rank": RANK, "t": [RANK] * 3})
    got: list[Any] = [None]
    r3 = dist.scatter_object_list(got, [("s", i) for i in range(WORLD)] if RANK == 0 else None, 0)
    g_list: list[Any] | None = [None] * WORLD if RANK == 1 else None
    r4 = dist.gather_object(("g", RANK), g_list, dst=1)
    return [fp(r1), fp(objs), fp(r2), fp(gathered), fp(r3), fp(got), fp(r4), fp(g_list)]


def c_p2p(ctx: Ctx) -> Any:
    out: dict[str, Any] = {}
    t = f(3)
    if RANK == 0:
        out["send"] = fp(dist.send(t, 1))
        got = torch.empty(2)
        out["recv_any"] = fp(dist.recv(got))  # any source: returns the sender's rank
        out["got"] = fp(got)
        w = dist.isend(f(4), dst=1, tag=3)
        out["isend"] = work_fp(w, future=False)
        w2 = dist.irecv(got2 := torch.empty(4), group=ctx.pair, group_src=1)
        out["irecv"] = work_fp(w2, got2, future=False)
        w3 = dist.irecv(got3 := torch.empty(1))
        assert w3 is not None
        w3.wait()
        out["irecv_any_source"] = fp(w3._source_rank())
        out["got3"] = fp(got3)
    else:
        got = torch.empty(3)
        out["recv"] = fp(dist.recv(got, 0))
        out["got"] = fp(got)
        out["send"] = fp(dist.send(f(2), dst=0))
        got4 = torch.empty(4)
        out["recv_tag"] = fp(dist.recv(got4, src=0, tag=3))
        out["got4"] = fp(got4)
        w = dist.isend(f(4), 0, ctx.pair)
        out["isend"] = work_fp(w, future=False)
        dist.send(torch.ones(1) * 7, 0)
    return out


def c_batch_isend_irecv(ctx: Ctx) -> Any:
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, f(3), PEER), dist.P2POp(dist.irecv, got, PEER)]
    works = dist.batch_isend_irecv(ops)
    kinds = [isinstance(w, dist.Work) for w in works]
    waits = [fp(w.wait()) for w in works]
    return {"n": len(works), "is_work": kinds, "waits": waits, "got": fp(got)}


def c_barrier(ctx: Ctx) -> Any:
    r1 = dist.barrier()
    w = dist.barrier(async_op=True)
    r3 = dist.barrier(ctx.pair, timeout=datetime.timedelta(seconds=30))
    r4 = dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    r5 = dist.monitored_barrier(ctx.pair, datetime.timedelta(seconds=30), True)
    return [fp(r1), work_fp(w), fp(r3), fp(r4), fp(r5)]


def c_subgroups(ctx: Ctx) -> Any:
    """new_subgroups (size 1: every rank its own), a DeviceMesh's group, an explicit pair."""
    a, b, c = f(2), f(2), f(2)
    r = [
        fp(dist.all_reduce(a, group=ctx.sub)),
        fp(dist.all_reduce(b, group=ctx.mesh_group)),
        fp(dist.all_reduce(c, group=ctx.pair)),
    ]
    w = dist.all_reduce(d := f(2), group=ctx.mesh_group, async_op=True)
    return [*r, fp([a, b, c]), work_fp(w, d)]


def c_not_a_member(ctx: Ctx) -> Any:
    """Rank 1 is not in ``member``: torch warns and returns None, touching nothing."""
    t = f(3)
    r1 = dist.all_reduce(t, group=ctx.member)
    r2 = dist.all_reduce(t, group=ctx.member, async_op=True)
    r3 = dist.broadcast(t, src=0, group=ctx.member)
    r4 = dist.barrier(group=ctx.member)
    out = [torch.empty(3)]
    r5 = dist.all_gather(out, f(3), group=ctx.member)
    return [fp(r1), fp(r2), fp(r3), fp(r4), fp(r5), fp(t)]


def c_bad_arguments(ctx: Ctx) -> Any:
    """Errors torch raises for wrong arguments reach the job as torch raises them."""
    out = []
    calls: list[Callable[[], Any]] = [
        lambda: dist.all_reduce(f(2), group="nosuch"),  # type: ignore[arg-type,unused-ignore]
        lambda: dist.broadcast(f(2), 0, "nosuch"),  # type: ignore[arg-type]
        lambda: dist.recv(torch.empty(1), src="a"),  # type: ignore[arg-type,unused-ignore]
        lambda: dist.isend(torch.empty(1)),
        lambda: dist.send(f(1), RANK),
        lambda: dist.all_reduce([f(2)]),  # type: ignore[arg-type,unused-ignore]
        lambda: dist.all_reduce(f(2), op="sum"),  # type: ignore[arg-type,unused-ignore]
        lambda: dist.all_reduce(),  # type: ignore[call-arg]
        lambda: dist.all_reduce(f(2), bogus=1),  # type: ignore[call-arg]
        lambda: dist.broadcast(f(2), src=0, group_src=0),
        lambda: dist.all_gather_into_tensor(torch.empty(5), f(2)),
        lambda: dist.all_gather([torch.empty(2)], f(2)),
    ]
    for call in calls:
        try:
            out.append({"ret": fp(call())})
        except Exception as exc:
            out.append(err_fp(exc))
    return out


def c_user_exception(ctx: Ctx) -> Any:
    """An exception raised in the job's own code around collectives keeps its type."""

    class Mine(Exception):
        pass

    out: list[Any] = []
    for body in ("step", "future_callback"):
        try:
            if body == "step":
                with collectives.step(0):
                    dist.all_reduce(f(2))
                    raise Mine("in a step")
            else:
                w = dist.all_reduce(f(2), async_op=True)

                def boom(_f: Any) -> None:
                    raise Mine("in a callback")

                w.get_future().then(boom).wait()
        except Mine as exc:
            out.append(["Mine", str(exc)])
        except Exception as exc:
            out.append(err_fp(exc))
    return out


def c_timeout(ctx: Ctx) -> Any:
    """A collective past its group's timeout (rank 1 never joins): the error, sync and async."""
    if RANK == 1:
        return None
    group = ctx.lonely[ctx.mode]
    out: list[Any] = []
    try:
        w = dist.all_reduce(f(2), group=group, async_op=True)
        out.append({"is_work": isinstance(w, dist.Work)})
        w.wait()
        out.append("no error")
    except Exception as exc:
        out.append(err_fp(exc, message=False))
    return out


def c_memory(ctx: Ctx) -> Any:
    """Whether a tensor handed to a collective outlives the job's own references."""

    def alive(make: Callable[[], tuple[torch.Tensor, Any]]) -> bool:
        t, keep = make()
        ref = weakref.ref(t)
        del t
        keep = None  # noqa: F841 - dropping what the case kept
        # gloo's worker thread lets go of a finished work's tensors a moment after the
        # job's thread returns: only a tensor still held after that counts
        for _ in range(100):
            gc.collect()
            if ref() is None:
                return False
            time.sleep(0.01)
        return True

    def sync() -> tuple[torch.Tensor, Any]:
        t = f(1000)
        dist.all_reduce(t)
        return t, None

    def async_waited() -> tuple[torch.Tensor, Any]:
        t = f(1000)
        dist.all_reduce(t, async_op=True).wait()
        return t, None

    def async_future() -> tuple[torch.Tensor, Any]:
        t = f(1000)
        dist.all_reduce(t, async_op=True).get_future().wait()
        return t, None

    def gathered() -> tuple[torch.Tensor, Any]:
        out = torch.empty(1000 * WORLD)
        dist.all_gather_into_tensor(out, f(1000))
        return out, None

    def in_step() -> tuple[torch.Tensor, Any]:
        t = f(1000)
        with collectives.step(1):
            w = dist.all_reduce(t, async_op=True)
            w.wait()
        return t, None

    def functional() -> tuple[torch.Tensor, Any]:
        import torch.distributed._functional_collectives as funcol

        r = funcol.all_reduce(f(1000), "sum", world())
        return r.wait() if hasattr(r, "wait") else r, None

    return {
        name: alive(fn)
        for name, fn in [
            ("sync", sync),
            ("async_waited", async_waited),
            ("async_future", async_future),
            ("gathered", gathered),
            ("in_step", in_step),
            ("functional", functional),
        ]
    }


def c_functional(ctx: Ctx) -> Any:
    import torch.distributed._functional_collectives as funcol

    a = funcol.all_reduce(f(3), "sum", world())
    b = funcol.all_gather_tensor(f(2), 0, ctx.mesh_group)
    c = funcol.reduce_scatter_tensor(f(2 * WORLD), "sum", 0, (ctx.mesh, 0))
    d = funcol.all_to_all_single(f(2 * WORLD), [2] * WORLD, [2] * WORLD, world())
    e = torch.ops._c10d_functional.all_reduce(f(2), "sum", world().group_name)
    e = torch.ops._c10d_functional.wait_tensor(e)
    return [fp(x * 1) for x in (a, b, c, d, e)] + [type(a).__name__]


def c_ddp(ctx: Ctx) -> Any:
    """DDP's own reducer (C++) and its standard comm hook (wrapped all_reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        if hooked:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(3, 4) * (RANK + 1)).sum().backward()
            opt.step()
        out.append(fp([p.detach() for p in model.parameters()]))
    return out


def c_fsdp2_async_unshard(ctx: Ctx) -> Any:
    """FSDP2 with ``unshard(async_op=True)``: it waits its all-gather only when the handle is
    a ``dist.Work`` (``isinstance``); counts the wrapper's waits while instrumented."""
    from torch.distributed.fsdp import fully_shard

    waits = [0]
    original = TimedWork.wait

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        waits[0] += 1
        return original(self, *args, **kwargs)

    TimedWork.wait = counting  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        for layer in model:
            fully_shard(layer, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        values = []
        layer0: Any = model[0]
        for _ in range(2):
            handle = layer0.unshard(async_op=True)
            assert handle is not None
            handle.wait()
            values.append(float(layer0.weight.detach().sum()))
            layer0.reshard()
        loss = model(torch.ones(2, 64) * (RANK + 1)).sum()
        loss.backward()
        values.append(round(float(loss.detach()), 4))
    finally:
        TimedWork.wait = original  # type: ignore[method-assign]
    return {"values": [round(v, 4) for v in values], "timed_waits": waits[0]}


CASES: list[tuple[str, Callable[[Ctx], Any]]] = [
    (name.removeprefix("c_"), fn) for name, fn in list(globals().items()) if name.startswith("c_")
]


def run_cases(ctx: Ctx) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in CASES:
        dist.barrier()  # the ranks start each case together (plain: not recorded anyway)
        before = session_records()
        print(f"case {ctx.mode} {name}", flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = case(ctx)
            except Exception as exc:
                value = {"case_raised": err_fp(exc)}
        seen = session_records() - before
        results[name] = {
            "value": value,
            "warnings": sorted(
                {
                    f"{w.category.__name__}: {re.sub(r'[0-9]+', 'N', str(w.message))[:100]}"
                    for w in caught
                    if "trainguard" not in str(w.message)
                }
            ),
            "records": seen,
        }
    return results


# ---------------------------------------------------------------------- uninstrument


def snapshot() -> dict[str, int]:
    """id() of every function of every torch.distributed module and of its classes'
    attributes (what instrument() may patch), and the functional kernels' registration."""
    out: dict[str, int] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module_name == "torch.distributed" or module_name.startswith("torch.distributed.")
        ):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", "") == module_name:
                for cattr, cvalue in list(vars(value).items()):
                    if callable(cvalue) or isinstance(cvalue, staticmethod | classmethod):
                        out[f"{module_name}.{attr}.{cattr}"] = id(cvalue)
            elif callable(value):
                out[f"{module_name}.{attr}"] = id(value)
    for op in ("all_reduce", "wait_tensor", "all_gather_into_tensor"):
        out[f"kernel:{op}"] = int(
            torch._C._dispatch_has_kernel_for_dispatch_key(
                f"_c10d_functional::{op}", "BackendSelect"
            )
        )
    return out


def main() -> None:
    import faulthandler

    if os.environ.get("TG_SWEEP_DEBUG"):
        faulthandler.dump_traceback_later(float(os.environ["TG_SWEEP_DEBUG"]), exit=True)
    out_dir = Path(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=RANK, world_size=WORLD
    )
    ctx = Ctx()
    # a group per death probe, made now: after a peer died no group can be made
    dead = {mode: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20)) for mode in "pi"}
    result: dict[str, Any] = {}
    t0, c0 = time.monotonic(), time.process_time()
    result["plain"] = run_cases(ctx)
    before = snapshot()
    collectives.instrument()
    patched = snapshot()
    ctx.mode = "instr"
    result["instr"] = run_cases(ctx)
    session = collectives.current()
    assert session is not None
    result["inflight_after"] = [(r.op, r.seq) for r in session.recorder._inflight.values()]
    collectives.uninstrument()
    after = snapshot()
    result["patched"] = sorted(k for k in before if patched.get(k) != before[k])
    result["not_restored"] = sorted(
        k for k in set(before) | set(after) if before.get(k) != after.get(k)
    )
    result["seconds"] = [time.monotonic() - t0, time.process_time() - c0]
    # Instrumented again while both ranks live (instrument() makes a group: collective);
    # the plain side of the death probe calls the function the wrapper wraps.
    session = collectives.instrument()
    plain_all_reduce = session.instrumenter.originals["all_reduce"]
    dist.barrier()
    if RANK == 1:  # a peer dies: rank 0's next collectives must fail alike
        (out_dir / f"rank{RANK}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    time.sleep(1.0)
    death: dict[str, Any] = {}
    for mode in ("plain", "instr"):
        call = plain_all_reduce if mode == "plain" else dist.all_reduce
        for kind in ("sync", "async"):
            try:
                if kind == "sync":
                    call(f(2), group=dead[mode[0]])
                else:
                    call(f(2), group=dead[mode[0]], async_op=True).wait()
                death[f"{mode}_{kind}"] = "no error"
            except Exception as exc:
                death[f"{mode}_{kind}"] = err_fp(exc, message=False)
    session = collectives.current()
    assert session is not None
    result["death_records_failed"] = [
        (r.op, r.ok) for r in session.recorder.history if r.group != ""
    ][-2:]
    result["death"] = death
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the world is broken: no teardown that could hang on the dead peer


if __name__ == "__main__":
    main()
