"""The dashboard's database reads: a node's GPU history in buckets, a job's checkpoints,
and a traffic plan's per-link load against ECMP. Plain functions of a ``Session`` (run on
a worker thread via ``Store.read``) or of a plan; no HTTP here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import Checkpoint, GpuHistory

#: Smallest history bucket: a few agent reports each, so report jitter leaves no false gaps.
MIN_BUCKET_S = 5.0
#: The series of a GPU's history, whichever store answers (database or Prometheus).
HISTORY_KEYS = (
    "power_w",
    "temperature_c",
    "sm_clock_mhz",
    "utilization_pct",
    "ecc_corrected",
    "ecc_uncorrected",
    "throttle_reasons",
)


def _bucketed(values: list[float], how: str) -> float | None:
    if not values:
        return None
    if how == "max":
        return max(values)
    return sum(values) / len(values)


def node_history(
    session: Session, node: str, since_unix_s: float, until_unix_s: float, points: int
) -> dict[str, Any]:
    """The node's GPU history in at most ``points`` buckets per GPU, on one shared time
    axis (the bucket ends, from the first bucket with data), so a chart's series line up.
    ``None`` where a GPU reported nothing in a bucket (a gap, not a zero)."""
    rows = session.scalars(
        select(GpuHistory)
        .where(GpuHistory.node_name == node, GpuHistory.end_unix_s >= since_unix_s)
        .order_by(GpuHistory.end_unix_s)
    ).all()
    # Buckets sized to the data there is: a node reporting for a minute gets 1 s buckets,
    # not four 15 s ones.
    start = max(since_unix_s, rows[0].end_unix_s) if rows else since_unix_s
    span = max(1.0, until_unix_s - start)
    # points - 1: bucket edges need not line up with ``start``, which costs one bucket.
    bucket_s = max(MIN_BUCKET_S, float(np.ceil(span / max(1, points - 1))))
    first = int(since_unix_s // bucket_s)
    last = int(until_unix_s // bucket_s)
    buckets = range(first, last + 1)
    acc: dict[int, dict[int, dict[str, list[float]]]] = {}
    for r in rows:
        b = int(r.end_unix_s // bucket_s)
        if b < first or b > last:
            continue
        slot = acc.setdefault(r.gpu_index, {}).setdefault(b, {})
        for key, value in (
            ("power_w", r.power_w_avg),
            ("temperature_c", r.temperature_c_max),
            ("sm_clock_mhz", r.sm_clock_mhz_avg),
            ("utilization_pct", r.utilization_gpu_pct_avg),
            ("ecc_corrected", r.ecc_corrected_total),
            ("ecc_uncorrected", r.ecc_uncorrected_total),
            ("throttle_reasons", bin(r.throttle_reasons_mask or 0).count("1")),
        ):
            if value is not None:
                slot.setdefault(key, []).append(float(value))
    # The axis starts at the first bucket with data: a node that began reporting a minute
    # ago gets a minute of chart, not an hour of empty axis.
    seen = [b for per in acc.values() for b in per]
    if seen:
        buckets = range(min(seen), last + 1)
    how = {"temperature_c": "max", "ecc_corrected": "max", "ecc_uncorrected": "max"}
    keys = HISTORY_KEYS
    gpus = []
    for index in sorted(acc):
        per = acc[index]
        gpus.append(
            {
                "index": index,
                **{
                    k: [_bucketed(per.get(b, {}).get(k, []), how.get(k, "avg")) for b in buckets]
                    for k in keys
                },
            }
        )
    return {
        "node": node,
        "bucket_s": bucket_s,
        "t": [(b + 1) * bucket_s for b in buckets] if gpus else [],
        "gpus": gpus,
    }


def job_checkpoints(session: Session, job: str, limit: int) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_name == job)
        .order_by(Checkpoint.time_unix_s.desc(), Checkpoint.rank)
        .limit(limit)
    ).all()
    return [
        {
            "step": r.step,
            "rank": r.rank,
            "node": r.node_name,
            "kind": r.kind,
            "tier": r.tier,
            "blocking_s": r.blocking_s,
            "duration_s": r.duration_s,
            "size_bytes": r.size_bytes,
            "path": r.path,
            "error": r.error,
            "time_unix_s": r.time_unix_s,
        }
        for r in rows
    ]


def plan_links(plan: Any, *, seed: int = 0, top: int = 200) -> list[dict[str, Any]]:
    """Bytes per link under ``plan`` and under one seeded ECMP draw of the same flows,
    busiest first (either way): where planning moved load off a hot link."""
    from controller.logic.traffic.compare import ecmp_paths, traffic_of

    topo = plan.topology
    n = len(topo.link_names)
    traffic = traffic_of(plan)
    paths = ecmp_paths(topo, traffic, np.random.default_rng(seed))
    sizes = np.asarray(traffic.flows.size_bytes, dtype=float)
    ecmp = np.zeros(n + 1)
    if paths.size:
        weights = np.repeat(sizes, paths.shape[1]) if paths.ndim == 2 else sizes
        flat = paths.ravel()
        keep = (flat >= 0) & (flat < n)
        ecmp = np.bincount(flat[keep], weights=weights[keep], minlength=n + 1).astype(float)
    planned = np.asarray(plan.loads_bytes, dtype=float)
    out = [
        {"link": topo.link_names[i], "plan_bytes": float(planned[i]), "ecmp_bytes": float(ecmp[i])}
        for i in range(n)
        if planned[i] > 0 or ecmp[i] > 0
    ]
    out.sort(key=lambda x: -max(x["plan_bytes"], x["ecmp_bytes"]))
    return out[:top]


__all__ = ["MIN_BUCKET_S", "job_checkpoints", "node_history", "plan_links"]
