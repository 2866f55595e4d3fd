"""The dashboard with a 2,048-node x 8-GPU simulated fleet, in headless Chromium.

A real controller (uvicorn in a thread of this process, SQLite in a temporary directory)
gets one report per node (8 simulated GPUs each), as agents send them. Debian's Chromium
(Playwright, ``/usr/bin/chromium``) signs in with a viewer token, then:

* ``fleet_interactive_ms``: navigation start to the first frame after all 2,048 cells are
  in the page, measured by the page's own clock (``performance.now()`` in a
  ``requestAnimationFrame`` callback); ``filter_ms`` is a state filter's click to its frame.
* ``update_latency_ms``: a report with XID 79 posted for one node (time taken here, just
  before the POST) to the frame after that node's cell turned "unhealthy" (``Date.now()``
  in the page; same machine, same clock). Repeated on different nodes; median and max.
* ``js_heap_mb``: the page's used JS heap (after a forced GC, over the DevTools protocol)
  at the start and every 15 s while the fleet stays live: ~50 reports/s and an isolate or
  release every second keep the stream busy. ``--quick`` runs 60 s, the default 600 s.

Everything runs on this machine's CPU (no GPU is involved; the GPUs are simulated).
``--json``: the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench._server import Server as _Server

CHROMIUM = Path(os.environ.get("TRAINGUARD_TEST_CHROMIUM", "/usr/bin/chromium"))
NODES = 2048
GPUS = 8


def Server(workdir: Path) -> _Server:
    """The dashboard bench's controller: every role, nodes that report once stay healthy."""
    # Nodes report once here (then only a few per second): keep them "healthy".
    return _Server(workdir, ("agent", "viewer", "operator"), node_lost_after_s=3600.0)


def node_name(i: int) -> str:
    return f"gpu-node-{i:04d}"


class Fleet:
    """Sends reports as 2,048 agents would (one sequence number per node)."""

    def __init__(self, agent: httpx.Client) -> None:
        self.agent = agent
        self.seq = [0] * NODES
        self.lock = threading.Lock()

    def report(self, i: int, *, xid: bool = False) -> None:
        name = node_name(i)
        now = time.time()
        gpus = []
        for g in range(GPUS):
            sample: dict[str, Any] = {
                "index": g,
                "uuid": f"GPU-{name}-{g}",
                "power_w": 550.0 + random.random() * 100,
                "energy_j": 1000.0,
                "temperature_c": 60.0 + random.random() * 10,
                "sm_clock_mhz": 1980,
                "utilization_gpu_pct": 95.0,
                "memory_used_bytes": 60 << 30,
                "ecc_corrected_total": 0,
                "ecc_uncorrected_total": 0,
            }
            if xid and g == 0:
                sample["xid_events"] = [{"code": 79, "time_unix_s": now}]
            gpus.append(sample)
        with self.lock:
            seq = self.seq[i]
            self.seq[i] += 1
        body = {
            "node": {
                "name": name,
                "hostname": f"{name}.cluster",
                "backend": "sim",
                "agent_version": "bench",
                "labels": {"rack": f"r{i // 16:03d}"},
                "gpus": [
                    {"index": g, "uuid": f"GPU-{name}-{g}", "name": "NVIDIA H100"}
                    for g in range(GPUS)
                ],
            },
            "agent_instance": "bench",
            "seq": seq,
            "sent_unix_s": now,
            "samples": [{"time_unix_s": now, "gpus": gpus}],
            "job": {"steps": []},
        }
        self.agent.post("/api/v1/reports", json=body).raise_for_status()


class Churn:
    """Background load while the page is live: reports and isolate/release flips."""

    def __init__(self, server: _Server, fleet: Fleet, skip: set[int]) -> None:
        self.server = server
        self.fleet = fleet
        self.skip = skip
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.isolated: set[int] = set()

    def _run(self) -> None:
        operator = self.server.client("operator")
        tick = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            for _ in range(5):  # ~50 reports/s
                i = random.randrange(NODES)
                if i not in self.skip:
                    self.fleet.report(i)
            if tick % 10 == 0:  # one isolate or release per second
                i = random.randrange(64, NODES)
                if i in self.isolated:
                    operator.post(f"/api/v1/nodes/{node_name(i)}/release", json={"reason": "b"})
                    self.isolated.discard(i)
                else:
                    operator.post(f"/api/v1/nodes/{node_name(i)}/isolate", json={"reason": "b"})
                    self.isolated.add(i)
            tick += 1
            self.stop.wait(max(0.0, 0.1 - (time.monotonic() - t0)))


def heap_mb(cdp: Any) -> float:
    cdp.send("HeapProfiler.collectGarbage")
    return float(cdp.send("Runtime.getHeapUsage")["usedSize"]) / 2**20


def measure(*, duration_s: float, samples: int, screenshot: Path | None) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="tg-bench-dash-") as tmp:
        server = Server(Path(tmp))
        try:
            fleet = Fleet(server.client("agent"))
            t0 = time.perf_counter()
            # Eight senders at a time, as many agents would (each waits for its commit).
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(fleet.report, range(NODES)))
            seed_s = time.perf_counter() - t0
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=str(CHROMIUM),
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
                )
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.set_default_timeout(120_000)
                page.goto(f"{server.url}/ui/#/fleet")
                page.fill("#token", server.tokens["viewer"])
                page.click("#login button[type=submit]")
                page.wait_for_selector("#whoami:has-text('viewer')")
                # Measured load: a fresh navigation with the token already in this tab.
                page.reload()
                page.wait_for_function(
                    "(n) => document.querySelectorAll('#fleet .cell').length === n", arg=NODES
                )
                interactive = page.evaluate(
                    "new Promise(r => requestAnimationFrame(() => r(performance.now())))"
                )
                filter_ms = page.evaluate(
                    """() => new Promise(r => {
                        const t = performance.now();
                        document.querySelector('.legend [data-state="healthy"]').click();
                        requestAnimationFrame(() => r(performance.now() - t));
                    })"""
                )
                page.click('.legend [data-state="healthy"]')  # filter off again
                cdp = page.context.new_cdp_session(page)
                heap = [(0.0, heap_mb(cdp))]

                targets = list(range(samples))
                churn = Churn(server, fleet, set(targets))
                churn.thread.start()
                latencies = []
                for i in targets:
                    name = node_name(i)
                    page.evaluate(
                        """(name) => {
                          window.__lat = window.__lat || {};
                          const cell = document.querySelector(`#fleet .cell[data-node="${name}"]`);
                          const seen = new MutationObserver(() => {
                            if (cell.dataset.state !== 'unhealthy') return;
                            seen.disconnect();
                            requestAnimationFrame(() => { window.__lat[name] = Date.now(); });
                          });
                          seen.observe(cell, { attributes: true });
                        }""",
                        name,
                    )
                    sent_ms = time.time() * 1000
                    fleet.report(i, xid=True)
                    page.wait_for_function("(n) => window.__lat && window.__lat[n]", arg=name)
                    latencies.append(page.evaluate("(n) => window.__lat[n]", name) - sent_ms)
                    time.sleep(0.5)
                if screenshot is not None:
                    screenshot.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(screenshot))
                start = time.monotonic()
                while (elapsed := time.monotonic() - start) < duration_s:
                    time.sleep(min(15.0, duration_s - elapsed))
                    heap.append((round(time.monotonic() - start, 1), heap_mb(cdp)))
                churn.stop.set()
                churn.thread.join(timeout=10)
                cells = page.evaluate("document.querySelectorAll('#fleet .cell').length")
                state = page.locator("#live").get_attribute("data-state")
                browser.close()
        finally:
            server.stop()
    return {
        "bench": "dashboard",
        "how": (
            "measured on this machine's CPU: controller (uvicorn, SQLite) in-process, "
            "headless Debian Chromium via Playwright; GPUs simulated"
        ),
        "nodes": NODES,
        "gpus_per_node": GPUS,
        "seed_reports_s": round(seed_s, 2),
        "fleet_interactive_ms": round(float(interactive), 1),
        "filter_ms": round(float(filter_ms), 1),
        "update_latency_ms": {
            "samples": len(latencies),
            "median": round(statistics.median(latencies), 1),
            "max": round(max(latencies), 1),
        },
        "live_s": duration_s,
        "js_heap_mb": {
            "start": round(heap[0][1], 2),
            "end": round(heap[-1][1], 2),
            "max": round(max(h for _, h in heap), 2),
            "series": [[t, round(h, 2)] for t, h in heap],
        },
        "cells_at_end": cells,
        "stream_state_at_end": state,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 s live instead of 600 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--samples", type=int, default=8, help="update-latency samples")
    parser.add_argument("--screenshot", type=Path, default=None, help="PNG of the fleet page")
    args = parser.parse_args(argv)
    if not CHROMIUM.exists():
        print(f"no Chromium at {CHROMIUM}; run `make browser`", flush=True)
        return 2
    result = measure(
        duration_s=60.0 if args.quick else 600.0,
        samples=max(1, min(args.samples, 64)),
        screenshot=args.screenshot,
    )
    if args.json:
        print(json.dumps(result))
    else:
        lat = result["update_latency_ms"]
        heap = result["js_heap_mb"]
        print(
            f"fleet ({NODES} nodes x {GPUS} GPUs) interactive: {result['fleet_interactive_ms']} ms"
        )
        print(f"state filter: {result['filter_ms']} ms")
        print(f"update latency: median {lat['median']} ms, max {lat['max']} ms ({lat['samples']})")
        print(f"JS heap: {heap['start']} MB -> {heap['end']} MB after {result['live_s']} s live")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
