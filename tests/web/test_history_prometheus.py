"""GPU history charts from Prometheus (``prometheus_url``), and the fallback when it is down.

Two Prometheus servers answer here. ``FakePrometheus`` is a small real HTTP server that
speaks ``GET /api/v1/query_range`` in the shape Prometheus documents
(https://prometheus.io/docs/prometheus/latest/querying/api/#range-queries) and evaluates
the PromQL subset the controller sends over samples the test holds; it always runs. The
real ``prometheus`` (Debian's package, ``apt-get install prometheus``) scraping the agent's
own ``/metrics`` server runs when the binary is there, and is skipped otherwise.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from controller.services.history_prometheus import KEYS, label_value
from tests import http_calls
from tests.waiting import wait_for
from tests.web.conftest import agent_report, post_report

QUERY = re.compile(
    r'^(?:(?P<fn>avg|max)_over_time\()?(?P<name>\w+)\{Hostname="(?P<host>(?:[^"\\]|\\.)*)"\}'
    r"(?:\[(?P<w>\d+)s\]\))?$"
)
LOOKBACK_S = 300.0  # Prometheus's default staleness window for an instant selector


class FakePrometheus:
    """``query_range`` over held samples: ``{name, labels, points: [(t, v)]}``."""

    def __init__(self) -> None:
        self.series: list[dict[str, Any]] = []
        self.queries: list[str] = []
        self.fail_with: dict[str, Any] | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                url = urlparse(self.path)
                args = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path != "/api/v1/query_range":
                    self._send(
                        404, {"status": "error", "errorType": "not_found", "error": url.path}
                    )
                    return
                fake.queries.append(args["query"])
                if fake.fail_with is not None:
                    self._send(400, fake.fail_with)
                    return
                self._send(200, fake.evaluate(args))

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def evaluate(self, args: dict[str, str]) -> dict[str, Any]:
        m = QUERY.match(args["query"])
        if m is None:
            return {"status": "error", "errorType": "bad_data", "error": "unsupported query"}
        host = json.loads(f'"{m["host"]}"')
        start, end, step = float(args["start"]), float(args["end"]), float(args["step"])
        result = []
        for s in self.series:
            if s["name"] != m["name"] or s["labels"].get("Hostname") != host:
                continue
            values = []
            k = 0
            while start + k * step <= end + 1e-9:
                t = start + k * step
                k += 1
                if m["fn"]:
                    inside = [v for ts, v in s["points"] if t - float(m["w"]) < ts <= t]
                    if inside:
                        agg = max(inside) if m["fn"] == "max" else sum(inside) / len(inside)
                        values.append([t, repr(agg)])
                else:
                    last = [v for ts, v in s["points"] if t - LOOKBACK_S < ts <= t]
                    if last:
                        values.append([t, repr(last[-1])])
            if values:
                result.append({"metric": {"__name__": s["name"], **s["labels"]}, "values": values})
        return {"status": "success", "data": {"resultType": "matrix", "result": result}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    try:
        yield fake
    finally:
        fake.close()


def _history(live: Any, node: str, **params: Any) -> dict[str, Any]:
    r = http_calls.get(
        f"{live.url}/api/v1/nodes/{node}/history",
        params=params,
        headers=live.headers("viewer"),
        timeout=20,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def _gpu_labels(node: str, gpu: int) -> dict[str, str]:
    return {
        "Hostname": node,
        "gpu": str(gpu),
        "UUID": f"GPU-{node}-{gpu}",
        "device": f"nvidia{gpu}",
    }


def test_history_comes_from_prometheus_when_configured(controller_factory, fake_prometheus) -> None:
    live = controller_factory(prometheus_url=fake_prometheus.url + "/")
    post_report(live, agent_report("n-0", 0, gpus=2))
    now = time.time()
    ts = [now - 240 + 2 * k for k in range(120)]

    def add(name: str, labels: dict[str, str], values: list[float]) -> None:
        points = list(zip(ts, values, strict=True))
        fake_prometheus.series.append({"name": name, "labels": labels, "points": points})

    n = len(ts)
    for gpu in (0, 1):
        labels = _gpu_labels("n-0", gpu)
        add("trainguard_gpu_power_watts", labels, [200.0 + 50 * gpu] * n)
        add("trainguard_gpu_temperature_celsius", labels, [60.0 + gpu + k % 3 for k in range(n)])
        add("trainguard_gpu_sm_clock_hertz", labels, [1.41e9] * n)
        add("trainguard_gpu_utilization_ratio", labels, [0.75] * n)
        ecc = "trainguard_gpu_ecc_errors_total"
        add(ecc, {**labels, "type": "corrected"}, [5.0 * (1 - gpu)] * n)
        add(ecc, {**labels, "type": "uncorrected"}, [0.0] * n)
        add("trainguard_gpu_clocks_event_reasons", labels, [float(0b101)] * n)
    # Another node's series must not leak in.
    fake_prometheus.series.append(
        {
            "name": "trainguard_gpu_power_watts",
            "labels": _gpu_labels("other", 7),
            "points": [(ts[-1], 1.0)],
        }
    )

    hist = _history(live, "n-0", window_s=300, points=30)
    assert hist["source"] == "prometheus"
    assert hist["bucket_s"] == 11.0  # ceil(300 / 29): the database read's bucket rule
    assert [g["index"] for g in hist["gpus"]] == [0, 1]
    assert all(set(g) == {"index", *KEYS} for g in hist["gpus"])
    t = hist["t"]
    assert t and all(math.isclose(b - a, 11.0) for a, b in itertools.pairwise(t))
    assert all(len(g[k]) == len(t) for g in hist["gpus"] for k in KEYS)
    assert t[0] >= ts[0] - 11 and t[-1] >= now  # starts at the first bucket with data
    for g in hist["gpus"]:
        gpu = g["index"]

        def seen(key: str, g: dict[str, Any] = g) -> list[float]:
            return [v for v in g[key] if v is not None]

        assert seen("power_w") and set(seen("power_w")) == {200.0 + 50 * gpu}
        assert set(seen("sm_clock_mhz")) == {1410.0}
        assert set(seen("utilization_pct")) == {75.0}
        assert max(seen("temperature_c")) == 62.0 + gpu  # max_over_time per bucket
        assert set(seen("ecc_corrected")) == {5.0 * (1 - gpu)}
        assert set(seen("ecc_uncorrected")) == {0.0}
        assert set(seen("throttle_reasons")) == {2.0}  # bits set in 0b101
    # Trainguard's metric names, selected by dcgm-exporter's Hostname label.
    assert all(f"{{Hostname={label_value('n-0')}}}" in q for q in fake_prometheus.queries)
    assert {q.split("{")[0] for q in fake_prometheus.queries} >= {
        "avg_over_time(trainguard_gpu_power_watts",
        "max_over_time(trainguard_gpu_temperature_celsius",
        "trainguard_gpu_clocks_event_reasons",
    }


def test_history_falls_back_to_the_database_when_prometheus_is_down(
    controller_factory, fake_prometheus
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here once the socket is closed
    live = controller_factory(prometheus_url=f"http://127.0.0.1:{closed}", prometheus_timeout_s=2)
    post_report(live, agent_report("n-0", 0, gpus=2))
    hist = wait_for(lambda: (h := _history(live, "n-0")) and h["gpus"] and h)
    assert hist["source"] == "database"
    assert hist["fallback"].startswith("Prometheus unavailable (")
    assert f"127.0.0.1:{closed} did not answer" in hist["fallback"]
    assert [g["index"] for g in hist["gpus"]] == [0, 1]
    assert all(set(g) == {"index", *KEYS} for g in hist["gpus"])  # the same chart either way
    assert {v for v in hist["gpus"][0]["power_w"] if v is not None} == {300.0}


def test_a_prometheus_error_answer_is_named_in_the_fallback(
    controller_factory, fake_prometheus
) -> None:
    fake_prometheus.fail_with = {
        "status": "error", "errorType": "bad_data", "error": "parse error at char 3",
    }  # fmt: skip
    live = controller_factory(prometheus_url=fake_prometheus.url)
    post_report(live, agent_report("n-0", 0, gpus=2))
    hist = _history(live, "n-0")
    assert hist["source"] == "database"
    assert "bad_data: parse error at char 3" in hist["fallback"]


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")
def test_a_real_prometheus_scraping_the_agent_feeds_the_same_chart(
    controller_factory, tmp_path: Path
) -> None:
    from agents.metrics import MetricsServer, MetricsSource
    from agents.stats import AgentStats
    from trainguard.wire import GpuInfo, GpuSample, NodeSample

    inventory = [GpuInfo(index=i, uuid=f"GPU-p-{i}", name="NVIDIA H100") for i in range(2)]
    gpus = [
        GpuSample(
            index=i, uuid=f"GPU-p-{i}", power_w=300.0 + i, temperature_c=61.0,
            sm_clock_mhz=1980, utilization_gpu_pct=50.0, ecc_corrected_total=3,
            ecc_uncorrected_total=0, throttle_reasons_mask=0b1,
        )
        for i in range(2)
    ]  # fmt: skip
    source = MetricsSource(
        hostname="node-p",
        inventory=inventory,
        stats=AgentStats(),
        spool_stats=lambda: (0, 0),
        spool_dropped_total=lambda: 0,
        latest=NodeSample(time_unix_s=time.time(), gpus=gpus),
    )
    agent = MetricsServer(source)
    agent_port = agent.start("127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        prom_port = s.getsockname()[1]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: agent\n    static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n"
    )
    assert PROMETHEUS is not None
    proc = subprocess.Popen(
        [
            PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{prom_port}"
    try:

        def scraped() -> bool:
            try:
                r = http_calls.get(
                    f"{url}/api/v1/query",
                    params={"query": 'count_over_time(trainguard_gpu_power_watts{gpu="0"}[1m])'},
                    timeout=2,
                )
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False  # 503 "Service Unavailable" until its storage is ready
            result = r.json()["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) >= 8

        wait_for(scraped, timeout_s=60, interval_s=0.5)
        live = controller_factory(prometheus_url=url)
        post_report(live, agent_report("node-p", 0, gpus=2))
        hist = _history(live, "node-p", window_s=60, points=12)
        assert hist["source"] == "prometheus", hist
        assert [g["index"] for g in hist["gpus"]] == [0, 1]
        for g in hist["gpus"]:
            i = g["index"]
            assert {v for v in g["power_w"] if v is not None} == {300.0 + i}
            assert {v for v in g["sm_clock_mhz"] if v is not None} == {1980.0}
            assert {v for v in g["utilization_pct"] if v is not None} == {50.0}
            assert {v for v in g["ecc_corrected"] if v is not None} == {3.0}
            assert {v for v in g["throttle_reasons"] if v is not None} == {1.0}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        agent.stop()
