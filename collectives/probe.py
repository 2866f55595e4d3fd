"""Link probes: timed ping-pong between rank pairs, to localize a slow link or NIC.

Every rank walks the same pair list in the same order and takes part only in the pairs that
hold it, so the probe cannot deadlock (the earliest unfinished pair always has both ranks
ready). For a pair ``(a, b)``, ``a`` sends ``size_bytes`` to ``b`` and ``b`` sends them
back: one untimed round to set up the connection, then ``repeats`` timed rounds. ``a``
reports ``duration_s`` = median round trip / 2, a one-way transfer time; bandwidth is
``size_bytes / duration_s``. The probe uses the original (unwrapped) send/recv, so it does
not shift the sequence numbers detectors align on, and it runs before the step's clock
starts, so it does not count as the step's compute.

Each transfer waits at most ``timeout_s``: a partner that never joins (it got the command
too late) yields ``ok=False`` instead of a hang.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

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
    repeats: int = 3,
    timeout_s: float = 30.0,
) -> list[ProbeResult]:
    results: list[ProbeResult] = []
    buf: torch.Tensor | None = None
    for src, dst in cmd.pairs:
        if rank not in (src, dst) or src == dst:
            continue
        if buf is None:
            buf = torch.zeros(cmd.size_bytes, dtype=torch.uint8)
        peer = dst if rank == src else src
        if peer >= world_size:
            if rank == src:
                error = f"rank {peer} is outside the job (world size {world_size})"
                results.append(_result(cmd, src, dst, 0.0, ok=False, error=error))
            continue
        delay = link_delay_s((src, dst))
        try:
            rtts = [
                _round(rank == src, peer, buf, isend, irecv, delay, timeout_s)
                for _ in range(repeats + 1)
            ][1:]
        except Exception as exc:
            if rank == src:
                results.append(_result(cmd, src, dst, 0.0, ok=False, error=_one_line(exc)))
            continue
        if rank == src:
            results.append(_result(cmd, src, dst, statistics.median(rtts) / 2))
    return results


def late_results(cmd: JobLinkProbe, rank: int, step: int) -> list[ProbeResult]:
    """Results for a probe whose ``at_step`` this rank had already passed."""
    error = f"probe command arrived at step {step}, after at_step {cmd.at_step}"
    return [
        _result(cmd, src, dst, 0.0, ok=False, error=error)
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
) -> float:
    timeout = timedelta(seconds=timeout_s)
    t0 = time.perf_counter()
    if initiator:
        _send(buf, peer, isend, delay_s, timeout)
        irecv(buf, src=peer, tag=PROBE_TAG).wait(timeout)
    else:
        irecv(buf, src=peer, tag=PROBE_TAG).wait(timeout)
        _send(buf, peer, isend, delay_s, timeout)
    return time.perf_counter() - t0


def _send(
    buf: torch.Tensor, peer: int, isend: Callable[..., Any], delay_s: float, timeout: timedelta
) -> None:
    if delay_s > 0:
        time.sleep(delay_s)  # an injected slow link costs this much per transfer
    isend(buf, dst=peer, tag=PROBE_TAG).wait(timeout)


def _result(
    cmd: JobLinkProbe, src: int, dst: int, duration_s: float, *, ok: bool = True, error: str = ""
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
    )


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


__all__ = ["PROBE_TAG", "late_results", "run_probe"]
