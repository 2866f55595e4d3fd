"""A node's GPU history from Prometheus, in the shape ``node_history`` gives from the database.

When ``prometheus_url`` is set, ``GET /api/v1/nodes/{name}/history`` asks Prometheus's HTTP
API (``GET /api/v1/query_range``) for the series the agents export (``agents.metrics``:
trainguard's metric names, dcgm-exporter's labels, ``Hostname`` = the node name) instead of
the controller's ``gpu_history`` table, so a site that keeps weeks of metrics in Prometheus
charts from there. The reply has the same keys, units and bucket axis as
:func:`controller.services.dashboard_reads.node_history` (the page draws one chart either
way); ``source`` says which one answered.

Per bucket: power, SM clock and utilization are ``avg_over_time`` over the bucket,
temperature and ECC totals ``max_over_time`` (as the database buckets do). Throttle reasons
are a bitmask gauge, which PromQL cannot count the bits of: each bucket shows the reasons
set in the newest sample at its end, not the average over the bucket.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx

from controller.services.dashboard_reads import HISTORY_KEYS, MIN_BUCKET_S
from trainguard.tls import default_context
from trainguard.urls import shown_url

#: Series of the chart -> (PromQL template, scale to the chart's unit). ``{sel}`` is the
#: label selector, ``{w}`` the bucket as a range (``15s``).
QUERIES: dict[str, tuple[str, float]] = {
    "power_w": ("avg_over_time(trainguard_gpu_power_watts{sel}[{w}])", 1.0),
    "temperature_c": ("max_over_time(trainguard_gpu_temperature_celsius{sel}[{w}])", 1.0),
    "sm_clock_mhz": ("avg_over_time(trainguard_gpu_sm_clock_hertz{sel}[{w}])", 1e-6),
    "utilization_pct": ("avg_over_time(trainguard_gpu_utilization_ratio{sel}[{w}])", 100.0),
    "ecc": ("max_over_time(trainguard_gpu_ecc_errors_total{sel}[{w}])", 1.0),
    "throttle_reasons": ("trainguard_gpu_clocks_event_reasons{sel}", 1.0),
}
KEYS = HISTORY_KEYS


class PrometheusUnavailable(Exception):
    """Prometheus did not answer, or answered something that is not a query result."""


def label_value(value: str) -> str:
    """``value`` as a PromQL double-quoted string (backslash, quote and newline escaped)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def bucket_axis(since: float, until: float, points: int) -> tuple[float, int, int]:
    """``(bucket_s, first, last)``: the database read's buckets (``b`` ends at
    ``(b + 1) * bucket_s``), sized to the whole window since Prometheus keeps all of it."""
    span = max(1.0, until - since)
    bucket_s = max(MIN_BUCKET_S, float(math.ceil(span / max(1, points - 1))))
    return bucket_s, int(since // bucket_s), int(until // bucket_s)


def _matrix(body: Any, query: str) -> list[dict[str, Any]]:
    if not isinstance(body, dict):
        raise PrometheusUnavailable(f"query {query!r}: the answer is not a JSON object")
    if body.get("status") != "success":
        raise PrometheusUnavailable(
            f"query {query!r}: {body.get('errorType', 'error')}: {body.get('error', '?')}"
        )
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise PrometheusUnavailable(f"query {query!r}: expected a matrix result")
    result = data.get("result")
    if not isinstance(result, list):
        raise PrometheusUnavailable(f"query {query!r}: the result is not a list")
    return result


class PrometheusHistory:
    """Reads a node's GPU history from one Prometheus server (a client per request: the
    node page asks once per load, and nothing is held open between loads)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        #: What messages (the log, the viewer's ``fallback``) say: no credentials of the URL.
        self.shown = shown_url(self.url)
        self.timeout_s = timeout_s

    async def _query_range(
        self, client: httpx.AsyncClient, query: str, start: float, end: float, step: float
    ) -> list[dict[str, Any]]:
        try:
            r = await client.get(
                f"{self.url}/api/v1/query_range",
                params={"query": query, "start": start, "end": end, "step": step},
            )
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(
                f"{self.shown} did not answer: {type(exc).__name__}: {exc}"
            ) from None
        try:
            body = r.json()
        except ValueError:
            raise PrometheusUnavailable(
                f"{self.shown} answered HTTP {r.status_code} without JSON"
            ) from None
        return _matrix(body, query)

    async def node_history(
        self, node: str, since_unix_s: float, until_unix_s: float, points: int
    ) -> dict[str, Any]:
        """The node's GPU history as :func:`node_history` shapes it (plus ``source``)."""
        bucket_s, first, last = bucket_axis(since_unix_s, until_unix_s, points)
        start, end = (first + 1) * bucket_s, (last + 1) * bucket_s
        sel = "{Hostname=" + label_value(node) + "}"
        window = f"{int(bucket_s)}s"
        queries = {
            key: template.replace("{sel}", sel).replace("{w}", window)
            for key, (template, _) in QUERIES.items()
        }
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=default_context()) as client:
            answers = await asyncio.gather(
                *(self._query_range(client, q, start, end, bucket_s) for q in queries.values())
            )
        count = last - first + 1
        per_gpu: dict[int, dict[str, list[float | None]]] = {}
        for (key, (_, scale)), series in zip(QUERIES.items(), answers, strict=True):
            for s in series:
                labels = s.get("metric") or {}
                try:
                    index = int(labels.get("gpu", ""))
                except ValueError:
                    continue  # not one of the agents' per-GPU series
                name = f"ecc_{labels.get('type')}" if key == "ecc" else key
                if name not in KEYS:
                    continue
                row = per_gpu.setdefault(index, {}).setdefault(name, [None] * count)
                for t, raw in s.get("values") or []:
                    slot = round((float(t) - start) / bucket_s)
                    value = float(raw)
                    if 0 <= slot < count and math.isfinite(value):
                        if key == "throttle_reasons":
                            row[slot] = float(bin(int(value)).count("1"))
                        else:
                            row[slot] = value * scale
        # The axis starts at the first bucket with data, as the database read's does.
        used = [
            next((i for i, x in enumerate(v) if x is not None), count)
            for gpu in per_gpu.values()
            for v in gpu.values()
        ]
        skip = min(used) if used else 0
        gpus = [
            {"index": index, **{k: per_gpu[index].get(k, [None] * count)[skip:] for k in KEYS}}
            for index in sorted(per_gpu)
        ]
        return {
            "node": node,
            "bucket_s": bucket_s,
            "t": [(b + 1) * bucket_s for b in range(first + skip, last + 1)] if gpus else [],
            "gpus": gpus,
            "source": "prometheus",
        }


__all__ = ["KEYS", "QUERIES", "PrometheusHistory", "PrometheusUnavailable", "label_value"]
