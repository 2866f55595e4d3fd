"""Acceptance sweep of the controller's ``/metrics`` and the dashboard's data routes, as an
SRE wiring trainguard into their monitoring would check them: the exposition parses with
prometheus_client's own parser whatever the agents report, names follow Prometheus's
conventions, label cardinality is bounded against what an agent may send, extreme readings
break neither the exposition nor the JSON routes, and the feeds stay small and fast for a
2,048-GPU job (256 nodes x 8 GPUs), measured in process."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests import http_calls
from tests.web.conftest import agent_report

LONG = "n" + "x" * 251 + "1"  # 253 characters: the longest name the wire takes


#: The families with a series per job (trainguard_job_findings_* are per outcome).
PER_JOB = (
    "trainguard_job_goodput_ratio",
    "trainguard_job_lost_seconds",
    "trainguard_job_checkpoint_committed_timestamp_seconds",
    "trainguard_job_checkpoint_interval_seconds",
    "trainguard_job_last_step_timestamp_seconds",
)


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _scrape(live: Any) -> str:
    r = http_calls.get(f"{live.url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def _step(job: str, rank: int, step: int, **extra: Any) -> dict[str, Any]:
    body = {
        "job": job,
        "rank": rank,
        "world_size": extra.pop("world_size", 1),
        "step": step,
        "step_time_s": 1.0,
        "compute_time_s": 0.8,
        "collective_wait_s": 0.2,
        "end_unix_s": time.time(),
    }
    body.update(extra)
    return body


def test_exposition_parses_and_follows_prometheus_conventions(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory()
    hostile = {"rack": 'a"b\\c\nd', "zone": "é😀\u2028<script>", "k": "x" * 128}
    xid = {"xid_events": [{"code": 79, "time_unix_s": time.time()}]}
    body = agent_report(LONG, 0, gpu_overrides={1: xid})
    body["node"]["labels"] = hostile
    body["node"]["hostname"] = "h"
    for gpu in body["node"]["gpus"]:
        gpu["uuid"] = f"GPU-{gpu['index']}"
    for sample in body["samples"]:
        for gpu in sample["gpus"]:
            gpu["uuid"] = f"GPU-{gpu['index']}"
    body["job"] = {"steps": [_step(LONG, 0, 1)]}
    live.report(body)
    live.report(agent_report("n-2", 0))
    text = _scrape(live)
    families = _families(text)
    assert "trainguard_nodes" in families and "trainguard_job_goodput_ratio" in families
    for family in families.values():
        name = family.name
        assert name.startswith("trainguard_"), name
        if name.endswith("_created") and family.type == "gauge":
            continue  # prometheus_client's creation time of a counter or histogram
        if family.type == "counter":
            assert all(s.name in (name + "_total", name + "_created") for s in family.samples)
        else:
            assert not name.endswith("_total"), f"{name}: a {family.type} named like a counter"
        for unit in ("seconds", "bytes", "ratio", "watts"):
            if unit in name:
                assert name.endswith(unit) or family.type in ("counter", "histogram"), name
        assert not any(u in name for u in ("_ms", "_millis", "_minutes", "_kb", "_mb")), name
        for sample in family.samples:
            assert not math.isnan(sample.value) or family.type == "gauge", sample
    # No label Prometheus sets on every target: ours would be renamed exported_job (the
    # default honor_labels: false), and the chart's rules would group every training job
    # under the scrape job's name.
    assert not any(
        {"job", "instance"} & set(s.labels) for f in families.values() for s in f.samples
    )
    # Prometheus drops a sample whose name and labels repeat within one scrape.
    keys = [(s.name, tuple(sorted(s.labels.items()))) for f in families.values() for s in f.samples]
    assert len(keys) == len(set(keys))
    # The dashboard's stream: one SSE message whatever the labels hold (JSON escapes the
    # newlines that would end it), and the labels come back exactly as reported.
    snapshot = live.controller.services.dashboard.snapshot().decode()
    assert snapshot.endswith("\n\n") and snapshot.count("\n") == 3, snapshot[:200]
    event, data = snapshot.split("\n")[:2]
    assert event == "event: nodes" and data.startswith("data: ")
    shown = {n["n"]: n for n in json.loads(data.removeprefix("data: "))["data"]}
    assert shown[LONG]["l"] == hostile
    node = live.read(f"/api/v1/nodes/{LONG}", history_s=0)
    assert node["labels"] == hostile
    # The histograms' buckets are cumulative and end at +Inf.
    for family in families.values():
        if family.type != "histogram":
            continue
        buckets = [s for s in family.samples if s.name.endswith("_bucket")]
        bounds = [float(s.labels["le"]) for s in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, family.name
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), family.name


def test_job_series_are_bounded_and_go_away_when_a_job_goes_quiet(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """Job names are whatever agents report: each must not add series forever."""
    from controller.services.remediation import metrics as rem_metrics

    # getattr: the same test, run against a controller without the bound, fails on it.
    most = getattr(rem_metrics, "MAX_JOB_SERIES", 500)
    idle_s = getattr(rem_metrics, "JOB_SERIES_IDLE_S", 3600.0)
    live = controller_factory()
    per_report = 100
    reports = most // per_report + 2
    for seq in range(reports):
        body = agent_report("n-1", seq, gpus=1, samples=1)
        body["job"] = {"steps": [_step(f"spray-{seq}-{i}", 0, 1) for i in range(per_report)]}
        live.report(body)
    assert len(live.controller.remediation.jobs) == reports * per_report

    def series() -> dict[str, set[str]]:
        families = _families(_scrape(live))
        return {name: {s.labels["job_name"] for s in families[name].samples} for name in PER_JOB}

    shown = series()
    ratio = shown["trainguard_job_goodput_ratio"]
    assert len(ratio) == most, len(ratio)
    assert {f"spray-{reports - 1}-{i}" for i in range(per_report)} <= ratio  # the newest
    assert shown["trainguard_job_lost_seconds"] == ratio
    assert shown["trainguard_job_last_step_timestamp_seconds"] == ratio

    # An hour without a record of theirs (the controller's clock): their series go away.
    state = live.controller.state
    quiet = {name for name in state.jobs if name.startswith(f"spray-{reports - 1}-")}
    for name in quiet:
        state.jobs[name].last_seen_unix_s -= idle_s + 1
    shown = series()
    assert not quiet & set().union(*shown.values())
    assert len(shown["trainguard_job_goodput_ratio"]) == most

    # A quiet job that reports again has its series back.
    body = agent_report("n-1", reports, gpus=1, samples=1)
    body["job"] = {"steps": [_step(f"spray-{reports - 1}-0", 0, 2)]}
    live.report(body)
    assert f"spray-{reports - 1}-0" in series()["trainguard_job_goodput_ratio"]


def test_extreme_step_times_break_neither_metrics_nor_json(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory()
    big = 1.7976931348623157e308
    body = agent_report("n-1", 0)
    body["job"] = {
        "steps": [
            _step("huge", 0, 1, step_time_s=big, end_unix_s=big),
            _step("huge", 0, 2, step_time_s=big, end_unix_s=0.0),
        ]
    }
    live.report(body)
    families = _families(_scrape(live))
    (ratio,) = families["trainguard_job_goodput_ratio"].samples
    assert ratio.labels == {"job_name": "huge"}
    # A step time from the future is taken as the report's arrival: it neither sticks as
    # the newest step (the not-durable alert would see a stopped job as stepping) nor
    # overflows the goodput ledger's wall time into NaN.
    assert 0.0 <= ratio.value <= 1.0, ratio
    (last,) = families["trainguard_job_last_step_timestamp_seconds"].samples
    assert last.value <= time.time()
    for path in ("/api/v1/jobs/huge/goodput", "/api/v1/jobs/huge/steps", "/api/v1/jobs/huge"):
        r = http_calls.get(f"{live.url}{path}", headers=live.headers("viewer"), timeout=10)
        assert r.status_code == 200, (path, r.status_code, r.text)
        json.loads(r.text, parse_constant=_refuse)  # strict JSON: no NaN or Infinity


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} in a JSON answer")


def test_gauges_after_a_restart_come_from_the_database(
    controller_factory: Any, fast_remediation_engine: float
) -> None:
    """A new leader (here: the same controller started again on its database) shows the
    cluster as stored, not zeros, and its own counters start over."""
    live = controller_factory()
    live.report(agent_report("n-a", 0))
    xid = {"xid_events": [{"code": 79, "time_unix_s": time.time()}]}
    live.report(agent_report("n-b", 0, gpu_overrides={2: xid}))

    def cluster(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        families = _families(text)
        return {
            (name, tuple(sorted(s.labels.items()))): s.value
            for name in ("trainguard_nodes", "trainguard_gpus", "trainguard_incidents_open")
            for s in families[name].samples
        }

    live.wait_ticks("RemediationEngine", 2)  # it has acted on the fault
    before = cluster(_scrape(live))
    assert before[("trainguard_nodes", (("health", "unhealthy"),))] == 1
    assert before[("trainguard_incidents_open", (("kind", "gpu_fault"),))] == 1
    live.restart()
    live.wait_ticks("RemediationEngine", 2)
    text = _scrape(live)
    assert cluster(text) == before
    families = _families(text)
    assert families["trainguard_controller_leader"].samples[0].value == 1
    assert families["trainguard_ingest_reports"].samples[0].value == 0


def test_dashboard_feeds_stay_small_and_fast_for_a_2048_gpu_job(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """256 nodes x 8 GPUs, one 2,048-rank job: what the pages read, measured in process."""
    import asyncio

    import httpx

    live = controller_factory()
    nodes, gpus, steps = 256, 8, 6
    world = nodes * gpus
    now = time.time()

    def body(k: int) -> dict[str, Any]:
        b = agent_report(f"node-{k:03d}", 0, gpus=gpus, samples=2)
        b["job"] = {
            "steps": [
                _step("big", k * gpus + i, s, world_size=world, end_unix_s=now - steps + s)
                for i in range(gpus)
                for s in range(steps)
            ]
        }
        return b

    async def post_all() -> None:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:

            async def one(k: int) -> None:
                async with limit:
                    r = await client.post(
                        "/api/v1/reports", json=body(k), headers=live.headers("agent")
                    )
                    assert r.status_code == 200, r.text

            await asyncio.gather(*(one(k) for k in range(nodes)))

    asyncio.run(post_all())
    reads = {
        "/api/v1/nodes": 500_000,
        "/api/v1/jobs?limit=500": 50_000,
        "/api/v1/jobs/big": 400_000,
        "/api/v1/jobs/big/steps?last=120": 1_000_000,
        "/api/v1/jobs/big/goodput": 10_000,
        "/api/v1/jobs/big/checkpoints?limit=200": 10_000,
        "/api/v1/incidents?limit=200": 200_000,
        "/api/v1/actions?limit=500": 500_000,
        "/api/v1/nodes/node-000?history_s=0": 50_000,
        "/api/v1/nodes/node-000/history?window_s=3600": 200_000,
        "/api/v1/power/domains": 100_000,
        "/api/v1/power/history?window_s=3600": 100_000,
        "/api/v1/status": 10_000,
        "/metrics": 100_000,
    }
    measured = {}
    with http_calls.client(base_url=live.url, timeout=30) as client:
        for path, most in reads.items():
            t0 = time.perf_counter()
            r = client.get(path, headers=live.headers("viewer"))
            took = time.perf_counter() - t0
            assert r.status_code == 200, (path, r.text[:300])
            measured[path] = (len(r.content), round(took * 1000))
            assert len(r.content) <= most, (path, len(r.content))
    steps_reply = http_calls.get(
        f"{live.url}/api/v1/jobs/big/steps?last=120",
        headers={**live.headers("viewer"), "Accept-Encoding": "gzip"},
        timeout=30,
    )
    assert len(steps_reply.json()["ranks"]) == world
    # The job page reloads this matrix on every change: gzip cuts what crosses the wire
    # (a port-forward, an ingress) several times; the event stream stays uncompressed.
    assert steps_reply.headers.get("content-encoding") == "gzip"
    assert steps_reply.num_bytes_downloaded * 3 < len(steps_reply.content)
    with (
        http_calls.client(base_url=live.url, timeout=30) as client,
        client.stream(
            "GET", "/api/v1/stream", headers={**live.headers("viewer"), "Accept-Encoding": "gzip"}
        ) as stream,
    ):
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in stream.headers
    t0 = time.perf_counter()
    snapshot = live.controller.services.dashboard.snapshot()
    measured["stream snapshot"] = (len(snapshot), round((time.perf_counter() - t0) * 1000))
    assert len(snapshot) <= 200_000
    print(measured)  # sizes are bounded above; times are for the reader (no wall bound)
