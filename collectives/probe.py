"""Link probes: timed ping-pong between rank pairs, to localize a slow link or NIC.

Every rank walks the same pair list in the same order and takes part only in the pairs that
hold it, so the probe cannot deadlock (the earliest unfinished pair always has both ranks
ready). For a pair ``(a, b)``, ``a`` sends ``size_bytes`` to ``b`` and ``b`` sends them
back: one untimed round to set up the connection, then ``repeats`` timed rounds. ``a``
reports ``duration_s`` = the fastest round trip / 2, a one-way transfer time; bandwidth is
``size_bytes / duration_s``. The fastest, not the median: a degraded link is slow in every
round, while a busy host (a rank descheduled, another job's burst) only slows some, and
under load a median of three let that noise hide the slow link. The probe uses the
original (unwrapped) send/recv, so it does not shift the sequence numbers detectors align
on, and it runs before the step's clock starts, so it does not count as the step's compute.

Each transfer waits at most ``timeout_s``: a partner that never joins (it got the command
too late) yields ``ok=False`` instead of a hang.

Where: on the group's device (``cuda:LOCAL_RANK`` under NCCL, which cannot send CPU
tensors; the CPU under gloo), on a dedicated process group over all ranks that
:func:`probe_group` creates once, at ``instrument()`` time (every rank calls it there, in
the same order, so the collective ``new_group`` cannot deadlock). The probe traffic thus has
its own communicator: it never shares one with the job's collectives, and it runs between
steps, never while a step's collectives are in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.wire import JobLinkProbe, ProbeResult

#: Tag that keeps probe traffic apart from the training's own point-to-point messages.
PROBE_TAG = 0x7467


def run_probe(
    cmd: JobLinkProbe,
    *,
    rank: int,
    world_size: int,
    isend: Callable[..., Any],
    irecv: Callable[..., Any],
    link_delay_s: Callable[[tuple[int, int]], float],
    repeats: int = 5,
    timeout_s: float = 30.0,
    group: Any = None,
    device: torch.device | None = None,
) -> list[ProbeResult]:
    """This rank's part of a probe round: results for the pairs it leads (``src``).

    The rounds go in passes over the whole pair list (pass 0 untimed), not all rounds of
    one pair and then the next: a pair's timed rounds are then a pass apart, so a burst of
    load on the host (a rank descheduled for a few hundred milliseconds) cannot slow all of
    them, while a degraded link slows every one. Back to back, one burst made a healthy
    neighbour pair slow too, and a ring's two slow pairs around one rank named that rank
    instead of the link (seen under ``make test``'s load). Every rank walks the same passes
    in the same order, so pairs still cannot deadlock; a pair that failed is dropped from
    later passes on both ends (each end fails its own wait within ``timeout_s``). Five timed
    rounds, not three: with a ring's few pairs per kind (a 4-rank job has two on a node, two
    across), the reference a pair is judged by is one other pair, and under make test's
    load three rounds of a healthy pair could all be slow enough to be called slow.
    """
    mine: list[tuple[int, int]] = []
    results: list[ProbeResult] = []
    for src, dst in cmd.pairs:
        if rank not in (src, dst) or src == dst:
            continue
        peer = dst if rank == src else src
        if peer >= world_size:
            if rank == src:
                error = f"rank {peer} is outside the job (world size {world_size})"
                results.append(_result(cmd, src, dst, 0.0, ok=False, error=error))
            continue
        mine.append((src, dst))
    if not mine:
        return results
    buf = torch.zeros(cmd.size_bytes, dtype=torch.uint8, device=device)
    rtts: dict[tuple[int, int], list[float]] = {pair: [] for pair in mine}
    failed: dict[tuple[int, int], str] = {}
    for timed in [False] + [True] * max(1, repeats):
        for src, dst in mine:
            if (src, dst) in failed:
                continue
            peer = dst if rank == src else src
            try:
                rtt = _round(
                    rank == src, peer, buf, isend, irecv, link_delay_s((src, dst)), timeout_s,
                    group,
                )  # fmt: skip
            except Exception as exc:
                failed[(src, dst)] = _one_line(exc)
                continue
            if timed:
                rtts[(src, dst)].append(rtt)
    for src, dst in mine:
        if rank != src:
            continue
        if (src, dst) in failed:
            results.append(_result(cmd, src, dst, 0.0, ok=False, error=failed[(src, dst)]))
        else:
            results.append(_result(cmd, src, dst, min(rtts[(src, dst)]) / 2))
    return results


def late_results(cmd: JobLinkProbe, rank: int, step: int) -> list[ProbeResult]:
    """Results for a probe whose ``at_step`` this rank had already passed: marked
    ``missed``, so the controller neither waits for them nor reads them as a failed link."""
    error = f"probe command arrived at step {step}, after at_step {cmd.at_step}"
    return [
        _result(cmd, src, dst, 0.0, ok=False, error=error, missed=True)
        for src, dst in cmd.pairs
        if src == rank and src != dst
    ]


def _round(
    initiator: bool,
    peer: int,
    buf: torch.Tensor,
    isend: Callable[..., Any],
    irecv: Callable[..., Any],
    delay_s: float,
    timeout_s: float,
    group: Any = None,
) -> float:
    timeout = timedelta(seconds=timeout_s)
    t0 = time.perf_counter()
    if initiator:
        _send(buf, peer, isend, delay_s, timeout, group)
        _wait(irecv(buf, src=peer, group=group, tag=PROBE_TAG), buf, timeout)
    else:
        _wait(irecv(buf, src=peer, group=group, tag=PROBE_TAG), buf, timeout)
        _send(buf, peer, isend, delay_s, timeout, group)
    return time.perf_counter() - t0


def _send(
    buf: torch.Tensor,
    peer: int,
    isend: Callable[..., Any],
    delay_s: float,
    timeout: timedelta,
    group: Any,
) -> None:
    if delay_s > 0:
        time.sleep(delay_s)  # an injected slow link costs this much per transfer
    _wait(isend(buf, dst=peer, group=group, tag=PROBE_TAG), buf, timeout)


def _wait(work: Any, buf: torch.Tensor, timeout: timedelta) -> None:
    work.wait(timeout)
    if buf.is_cuda:  # the probe, not the job, is timed here: wait for the transfer itself
        torch.cuda.current_stream(buf.device).synchronize()


def probe_device(backend: str) -> torch.device:
    """The device a probe buffer must live on for ``backend``."""
    if "nccl" in backend.lower() and torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK", "")
        index = int(local) if local.isdigit() else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def probe_group(world_size: int) -> Any:
    """The probes' own process group over all ranks (collective: every rank, same point)."""
    if world_size < 2:
        return None
    return dist.new_group(ranks=list(range(world_size)), backend=dist.get_backend())


def _result(
    cmd: JobLinkProbe,
    src: int,
    dst: int,
    duration_s: float,
    *,
    ok: bool = True,
    error: str = "",
    missed: bool = False,
) -> ProbeResult:
    return ProbeResult(
        job=cmd.job,
        probe_id=cmd.id,
        src_rank=src,
        dst_rank=dst,
        size_bytes=cmd.size_bytes,
        duration_s=duration_s,
        ok=ok,
        error=error,
        missed=missed,
    )


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


__all__ = ["PROBE_TAG", "late_results", "probe_device", "probe_group", "run_probe"]
