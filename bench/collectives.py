"""Per-call cost of collectives instrumentation next to plain torch.distributed, same run.

Two gloo ranks on this machine call ``all_reduce`` on a small tensor in alternating blocks:
the original function (kept by the instrumenter) and the wrapped one, interleaved call by
call, with the watchdog and shipping threads running in both cases. Reported: the median
time per call of each, their difference (the overhead per call) and ratio; then plain and
instrumented synthetic training steps (matmul compute and ``calls_per_step`` collectives,
interleaved step by step), whose median step times give the overhead as a share of a step.
A 2-rank gloo round trip on a loaded box jitters by far more than the wrapper costs, so the
wrapper's own cost is also measured rank-locally around a no-op (no communication at all),
and the load average is printed next to the figures. Finally a single-rank gloo group runs
real ``all_reduce`` calls in interleaved blocks of plain and wrapped calls inside a step,
pinned to one CPU; the median of the block differences is the per-call overhead without
another process's scheduling, or cross-core hand-offs, in the way (on 2 cores, two ranks
plus their threads contend for the CPUs).

The same blocks also time the device path (``collectives.timing``): with CUDA events on a
GPU (``overhead_us_per_call_cuda_events``, ``null`` without one) and, everywhere, with its
CPU stand-in (marks that fire with the Work's future). Last, a real FSDP2 + DTensor +
pipelining run on 2 gloo ranks with torch's Flight Recorder on gives
``collectives_seen_ratio``: collectives the wrapper saw / collectives torch recorded for the
same steps (``bench.collectives_parallel``; target 1.0).

    python -m bench.collectives [--quick] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn as _torch_spawn

import collectives
from collectives.timing import CpuEventClock, CudaEventClock, EventClock
from collectives.wrap import OPS

from . import collectives_parallel

WORLD = 2


#: Step numbers that keep increasing within a rank, as a training loop's do (a number
#: that goes back is taken as a new epoch and renumbered, with a warning: docs/collectives.md).
_STEPS = itertools.count()


def _spawn(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn`` with a typed face (torch leaves it unannotated)."""
    _torch_spawn(fn, args=args, nprocs=nprocs, join=True)  # type: ignore[no-untyped-call]


def _per_call(plain: Any, wrapped: Any, tensor: torch.Tensor, calls: int) -> dict[str, float]:
    """Interleave single calls (order flipped every round) and time each one: a scheduler
    hiccup then hits one sample, not a whole block, and both kinds see the same load."""
    clock = time.perf_counter
    samples: dict[str, list[float]] = {"plain": [], "wrapped": []}
    dist.barrier()
    for i in range(calls):
        order = (("plain", plain), ("wrapped", wrapped))
        for kind, fn in order if i % 2 else order[::-1]:
            t0 = clock()
            fn(tensor)
            samples[kind].append(clock() - t0)
    return {kind: statistics.median(v) * 1e6 for kind, v in samples.items()}


def _step(fn: Any, tensor: torch.Tensor, calls: int, weights: torch.Tensor, mark: bool) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    with collectives.step(next(_STEPS)) if mark else contextlib.nullcontext():
        for _ in range(calls):
            for _ in range(4):
                weights @ weights
            fn(tensor)
    return time.perf_counter() - t0


def _wrapper_cost_us(calls: int, repeats: int) -> tuple[float, float]:
    """Time of the wrapper around a no-op original: the instrumentation's own cost.

    Returns (best, median) over repeats; the best of repeats (as ``timeit`` reports) is the
    intrinsic cost, the median adds whatever else the loaded machine was doing."""
    session = collectives.current()
    assert session is not None
    inst = session.instrumenter

    def plain(tensor: torch.Tensor, **kwargs: Any) -> None:
        return None

    noop = inst._make_wrapper("all_reduce", OPS["all_reduce"], plain)
    tensor = torch.ones(4)
    plain_s, wrapped_s = [], []
    with collectives.step(next(_STEPS)):
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                plain(tensor)
            t1 = time.perf_counter()
            for _ in range(calls):
                noop(tensor)
            t2 = time.perf_counter()
            plain_s.append((t1 - t0) / calls * 1e6)
            wrapped_s.append((t2 - t1) / calls * 1e6)
    best = min(wrapped_s) - min(plain_s)
    return best, statistics.median(w - p for w, p in zip(wrapped_s, plain_s, strict=True))


def _rank(rank: int, store: str, out: str, quick: bool) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    session = collectives.instrument(
        "bench", agent_socket=str(Path(store).with_name("no-agent.sock"))
    )
    original = session.instrumenter.originals["all_reduce"]
    calls, steps = (800, 10) if quick else (4000, 40)
    tensor = torch.ones(16)
    _per_call(original, dist.all_reduce, tensor, 100)  # warm both paths
    per_call = _per_call(original, dist.all_reduce, tensor, calls)
    weights = torch.randn(160, 160)
    step_calls = 20
    step_plain: list[float] = []
    step_wrapped: list[float] = []
    for i in range(steps):
        runs = [(step_plain, original, False), (step_wrapped, dist.all_reduce, True)]
        for out_list, fn, mark in runs if i % 2 else runs[::-1]:
            out_list.append(_step(fn, tensor, step_calls, weights, mark))
    own_us, own_median_us = _wrapper_cost_us(2000, 21)
    collectives.uninstrument()
    dist.destroy_process_group()
    if rank != 0:
        return
    plain_us, wrapped_us = per_call["plain"], per_call["wrapped"]
    step_s = statistics.median(step_plain)
    step_wrapped_s = statistics.median(step_wrapped)
    result = {
        "world_size": WORLD,
        "tensor_bytes": tensor.numel() * tensor.element_size(),
        "calls": calls,
        "plain_us_per_call": round(plain_us, 2),
        "wrapped_us_per_call": round(wrapped_us, 2),
        "overhead_us_per_call": round(wrapped_us - plain_us, 2),
        "ratio": round(wrapped_us / plain_us, 4),
        "wrapper_own_us_per_call": round(own_us, 2),
        "wrapper_own_us_per_call_median": round(own_median_us, 2),
        "steps": steps,
        "calls_per_step": step_calls,
        "step_s_plain": round(step_s, 6),
        "step_s_wrapped": round(step_wrapped_s, 6),
        # per-call overhead times calls per step, over the plain step: stable under load
        "overhead_pct_of_step": round(
            100 * step_calls * (wrapped_us - plain_us) * 1e-6 / step_s, 3
        ),
        # the same share read directly off interleaved step times: noisy on a loaded box
        "overhead_pct_of_step_measured": round(100 * (step_wrapped_s - step_s) / step_s, 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "target_us_per_call": 10.0,
        "target_pct_of_step": 1.0,
    }
    Path(out).write_text(json.dumps(result))


def _single_rank(_index: int, store: str, out: str, quick: bool) -> None:
    """Interleaved blocks of plain and wrapped all_reduce on a 1-rank gloo group.

    The process is pinned to one CPU: unpinned, the training thread and gloo's worker
    thread hand each call across cores, which on a 2-core VM made the plain call swing
    between 55 and 106 µs from run to run and buried the wrapper's few µs in that noise.
    Both arms run pinned alike.
    """
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    session = collectives.instrument(
        "bench", agent_socket=str(Path(store).with_name("no-agent.sock"))
    )
    original = session.instrumenter.originals["all_reduce"]
    tensor = torch.ones(16)

    def block(fn: Any, calls: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn(tensor)
        return (time.perf_counter() - t0) / calls, (time.thread_time() - c0) / calls

    diffs, plain, cpu_diffs = [], [], []
    with collectives.step(next(_STEPS)):
        for i in range(60 if quick else 200):
            pair = (original, dist.all_reduce) if i % 2 else (dist.all_reduce, original)
            times = {fn: block(fn, 500) for fn in pair}
            diffs.append(times[dist.all_reduce][0] - times[original][0])
            plain.append(times[original][0])
            # The training thread's own CPU time: what the wrapper takes from training,
            # free of the wake-up latency of gloo's threads that swings wall time.
            cpu_diffs.append(times[dist.all_reduce][1] - times[original][1])
    event_diffs = _event_path_diffs(session, original, tensor, block, 30 if quick else 100)
    collectives.uninstrument()
    dist.destroy_process_group()
    Path(out).write_text(
        json.dumps(
            {
                "plain_us_per_call_1rank": round(statistics.median(plain) * 1e6, 2),
                "overhead_us_per_call_1rank": round(statistics.median(diffs) * 1e6, 2),
                "overhead_cpu_us_per_call_1rank": round(statistics.median(cpu_diffs) * 1e6, 2),
                "overhead_us_per_call_event_path_cpu": round(
                    statistics.median(event_diffs) * 1e6, 2
                ),
            }
        )
    )


def _use_clock(session: Any, clock: EventClock | None, device_only: bool) -> None:
    session.instrumenter.clock = session.recorder.clock = clock
    session.instrumenter._device_only = device_only


def _event_path_diffs(
    session: Any, original: Any, tensor: torch.Tensor, block: Any, rounds: int
) -> list[float]:
    """Wrapped calls timed by marks (the device path, CPU marks) minus plain calls, in
    interleaved blocks inside steps; the poller closes the records in the background."""
    _use_clock(session, CpuEventClock(), device_only=False)
    diffs = []
    for i in range(rounds):
        with collectives.step(next(_STEPS)):
            pair = (original, dist.all_reduce) if i % 2 else (dist.all_reduce, original)
            times = {fn: block(fn, 200) for fn in pair}
        diffs.append(times[dist.all_reduce][0] - times[original][0])
    _use_clock(session, None, device_only=False)
    return diffs


def _cuda_rank(_index: int, store: str, out: str, quick: bool) -> None:
    """1-rank NCCL on the GPU: wrapped calls with CUDA events vs plain, and without events."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    session = collectives.instrument(
        "bench", agent_socket=str(Path(store).with_name("no-agent.sock"))
    )
    original = session.instrumenter.originals["all_reduce"]
    tensor = torch.ones(16, device="cuda")

    def block(fn: Any, calls: int) -> float:
        torch.cuda.synchronize()  # the bench's own sync, outside the timed calls' launches
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(tensor)
        return (time.perf_counter() - t0) / calls

    with_events, without = [], []
    for i in range(30 if quick else 100):
        with collectives.step(next(_STEPS)):
            _use_clock(session, CudaEventClock(), device_only=True)
            pair = (original, dist.all_reduce) if i % 2 else (dist.all_reduce, original)
            times = {fn: block(fn, 200) for fn in pair}
            with_events.append(times[dist.all_reduce] - times[original])
            _use_clock(session, None, device_only=True)
            times = {fn: block(fn, 200) for fn in pair}
            without.append(times[dist.all_reduce] - times[original])
    torch.cuda.synchronize()
    collectives.uninstrument()
    dist.destroy_process_group()
    Path(out).write_text(
        json.dumps(
            {
                "overhead_us_per_call_cuda_events": round(statistics.median(with_events) * 1e6, 2),
                "overhead_us_per_call_cuda_no_events": round(statistics.median(without) * 1e6, 2),
            }
        )
    )


def _seen_rank(rank: int, store: str, out: str, steps: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    collectives.instrument("bench", agent_socket=str(Path(store).with_name("no-agent.sock")))
    result = collectives_parallel.run(steps)
    collectives.uninstrument()
    dist.destroy_process_group()
    counts = {}
    for name in collectives_parallel.SCENARIOS:
        cmp = collectives_parallel.seen(result, name)
        counts[name] = {"listed": cmp.listed, "seen": cmp.seen, "missing": cmp.missing}
    Path(f"{out}.{rank}").write_text(json.dumps(counts))


def seen_ratios(tmp: str, steps: int) -> dict[str, Any]:
    """``collectives_seen_ratio`` per workload, both ranks together."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = "4000"  # before the children create their groups
    out = os.path.join(tmp, "seen.json")
    _spawn(_seen_rank, (os.path.join(tmp, "store2"), out, steps), WORLD)
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    ratios: dict[str, float | None] = {}
    missing: dict[str, list[Any]] = {}
    for name in collectives_parallel.SCENARIOS:
        listed = sum(r[name]["listed"] for r in per_rank)
        got = sum(r[name]["seen"] for r in per_rank)
        ratios[name] = round(got / listed, 4) if listed else None
        missing[name] = [m for r in per_rank for m in r[name]["missing"]]
    return {
        "collectives_seen_ratio": ratios,
        "collectives_seen_source": {
            "fsdp2": "flight_recorder",
            "dtensor": "flight_recorder",
            "compiled": "flight_recorder",
            "pipeline": "profiler_c10d_ops",
        },
        "collectives_seen_missing": missing,
        "collectives_seen_steps": steps,
    }


def measure(quick: bool = False) -> dict[str, Any]:
    """Run the two-rank measurement; other benchmarks (bench.detect) can call this."""
    with tempfile.TemporaryDirectory(prefix="tgbench") as tmp:
        out = os.path.join(tmp, "result.json")
        _spawn(_rank, (os.path.join(tmp, "store"), out, quick), WORLD)
        result: dict[str, Any] = json.loads(Path(out).read_text())
        single = os.path.join(tmp, "single.json")
        _spawn(_single_rank, (os.path.join(tmp, "store1"), single, quick), 1)
        result.update(json.loads(Path(single).read_text()))
        result["overhead_us_per_call_cuda_events"] = None  # measured only on a GPU
        if torch.cuda.is_available() and dist.is_nccl_available():
            cuda = os.path.join(tmp, "cuda.json")
            _spawn(_cuda_rank, (os.path.join(tmp, "store3"), cuda, quick), 1)
            result.update(json.loads(Path(cuda).read_text()))
        result.update(seen_ratios(tmp, 2 if quick else 4))
        result["overhead_pct_of_step_1rank"] = round(
            100
            * result["calls_per_step"]
            * result["overhead_us_per_call_1rank"]
            * 1e-6
            / result["step_s_plain"],
            3,
        )
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--json", action="store_true", help="last stdout line is JSON")
    args = parser.parse_args(argv)
    result = measure(args.quick)
    rows = [
        ("all_reduce, plain torch.distributed", f"{result['plain_us_per_call']:.1f} µs/call"),
        ("all_reduce, instrumented", f"{result['wrapped_us_per_call']:.1f} µs/call"),
        ("overhead per call (target < 10 µs)", f"{result['overhead_us_per_call']:.1f} µs"),
        ("ratio wrapped / plain", f"{result['ratio']:.3f}"),
        (
            "overhead per call, 1-rank gloo on one CPU, interleaved blocks (target < 10 µs)",
            f"{result['overhead_us_per_call_1rank']:.1f} µs over "
            f"{result['plain_us_per_call_1rank']:.1f} µs",
        ),
        (
            "training-thread CPU time added per call, same blocks",
            f"{result['overhead_cpu_us_per_call_1rank']:.1f} µs",
        ),
        (
            "overhead per call through the device path with CPU marks, same blocks",
            f"{result['overhead_us_per_call_event_path_cpu']:.1f} µs",
        ),
        (
            "overhead per call with CUDA events (GPU only)",
            "n/a (no GPU)"
            if result["overhead_us_per_call_cuda_events"] is None
            else f"{result['overhead_us_per_call_cuda_events']:.1f} µs",
        ),
        *(
            (f"collectives seen / recorded by torch, {name} on gloo (target 1.0)", str(ratio))
            for name, ratio in result["collectives_seen_ratio"].items()
        ),
        (
            "load average (1 min) on this machine",
            f"{result['load_avg_1m']} on {result['cpus']} cpus",
        ),
        (
            "wrapper's own cost (no-op call), best / median",
            f"{result['wrapper_own_us_per_call']:.1f} / "
            f"{result['wrapper_own_us_per_call_median']:.1f} µs",
        ),
        (
            f"share of a {result['step_s_plain'] * 1e3:.1f} ms step with "
            f"{result['calls_per_step']} calls (target < 1%)",
            f"{result['overhead_pct_of_step']:.2f} %",
        ),
        (
            "same, from the 1-rank per-call overhead",
            f"{result['overhead_pct_of_step_1rank']:.2f} %",
        ),
        (
            "same, read off interleaved step times",
            f"{result['overhead_pct_of_step_measured']:.2f} %",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'MEASURE'.ljust(width)}  VALUE")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
