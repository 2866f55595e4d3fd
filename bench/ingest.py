"""Controller ingest capacity: how many 8-GPU nodes one controller process keeps up with.

One controller process (``controller.server.serve``) is fed by a separate load-generator
process of simulated agents. Each request is one node's report at the agent's defaults
(sampling 1 s, reporting 5 s: 5 samples x 8 GPUs per report); node ``i`` reports at phase
``i/N`` of the 5-s interval, so N nodes offer N/5 reports/s. Latency is measured from the
moment a report was *due* to the end of its reply, so a controller that falls behind is
charged for the queueing it causes (no coordinated omission).

A level "keeps up" when the reports answered per second are at least 98% of those offered,
none failed, and p99 latency stays under 100 ms. Levels rise (256, 512, 1024, 2048, ...)
until one fails at or above 2,048 (the latency curve's levels always run); ``max_nodes`` is
the last level below the first one that failed, so a lucky level above a failed one never
counts. The baseline in the same run is the HTTP floor: ``GET /healthz`` at the rate of the
largest level, through the same client, so the table shows what ingest costs on top of a
bare request.

    python -m bench.ingest [--quick] [--json] [--backends sqlite,postgres]

With ``--json`` the last stdout line is
``{"postgres": {"max_nodes", "gpu_samples_per_s", "p99_ms", ...}, "sqlite": {...}}``. A
backend that could not be measured (PostgreSQL unreachable) is still there, as
``{"error": "<why>", "max_nodes": null, "gpu_samples_per_s": null, "p99_ms": null}``, and
its table row says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPUS = 8
SAMPLES = 5
REPORT_INTERVAL_S = 5.0
P99_TARGET_MS = 100.0
KEEP_UP_RATIO = 0.98
TOKEN = "bench-agent-" + "x" * 20
CURVE_LEVELS = (256, 1024, 2048)
PG_SERVER = os.environ.get("TRAINGUARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


# --------------------------------------------------------------------------- load generator


def _report_template(node: str, instance: str) -> bytes:
    """A report body with ``%d`` where the seq goes (pre-serialized: the generator must be
    cheap, it shares the machine with the controller)."""
    now = time.time()
    gpus = [
        {"index": i, "uuid": f"GPU-{node}-{i}", "name": "NVIDIA H100 80GB HBM3"}
        for i in range(GPUS)
    ]
    samples = [
        {
            "time_unix_s": now - SAMPLES + k,
            "gpus": [
                {
                    "index": i,
                    "uuid": f"GPU-{node}-{i}",
                    "power_w": 550.0 + 10 * i + k,
                    "energy_j": 1.0e9 + k * 550,
                    "power_limit_w": 700.0,
                    "temperature_c": 61.0 + i,
                    "sm_clock_mhz": 1980,
                    "mem_clock_mhz": 2619,
                    "utilization_gpu_pct": 97.0,
                    "utilization_mem_pct": 61.0,
                    "memory_used_bytes": 71 << 30,
                    "memory_total_bytes": 80 << 30,
                    "throttle_reasons_mask": 0,
                    "ecc_corrected_total": 3,
                    "ecc_uncorrected_total": 0,
                    "pcie_link_gen": 5,
                    "pcie_link_width": 16,
                    "nvlink_crc_errors_total": 0,
                }
                for i in range(GPUS)
            ],
            "node_power_w": 5200.0,
            "node_power_source": "rapl",
        }
        for k in range(SAMPLES)
    ]
    body = {
        "node": {
            "name": node,
            "hostname": node,
            "labels": {"rack": f"r{hash(node) % 64}"},
            "backend": "sim",
            "agent_version": "bench",
            "gpus": gpus,
        },
        "agent_instance": instance,
        "seq": 987654321,
        "sent_unix_s": now,
        "samples": samples,
    }
    return json.dumps(body).replace('"seq": 987654321', '"seq": %d').encode()


class _Conn:
    """A minimal keep-alive HTTP/1.1 client connection (httpx costs ~10x more CPU)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, head: bytes, body: bytes) -> int:
        for attempt in range(2):
            try:
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                assert self.reader is not None
                self.writer.write(head + body)
                response_head = await self.reader.readuntil(b"\r\n\r\n")
                status = int(response_head[9:12])
                length = 0
                for line in response_head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await self.reader.readexactly(length)
                return status
            except (ConnectionError, asyncio.IncompleteReadError):
                if self.writer is not None:
                    self.writer.close()
                self.reader = self.writer = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


async def _drive(
    url: str, nodes: int, duration_s: float, warmup_s: float, path: str, pool_size: int
) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    instance = secrets.token_hex(4)
    templates = [_report_template(f"node-{i:05d}", instance) for i in range(nodes)]
    pool: asyncio.Queue[_Conn] = asyncio.Queue()
    for _ in range(pool_size):
        pool.put_nowait(_Conn(host, int(port)))
    latencies: list[float] = []
    failures = 0
    answered = 0
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    measure_from = start + warmup_s
    end = measure_from + duration_s
    tasks: set[asyncio.Task[None]] = set()

    async def send(index: int, seq: int, due: float) -> None:
        nonlocal failures, answered
        if path == "/healthz":
            head, body = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), b""
        else:
            body = templates[index] % seq
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
        conn = await pool.get()
        try:
            status = await asyncio.wait_for(conn.request(head, body), timeout=30)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            status = 0
            conn.reader = conn.writer = None
        finally:
            pool.put_nowait(conn)
        done = loop.time()
        if due >= measure_from and due < end:
            if status == 200:
                answered += 1
                latencies.append((done - due) * 1000)
            else:
                failures += 1

    cycle = 0
    while True:
        base = start + cycle * REPORT_INTERVAL_S
        if base >= end:
            break
        for i in range(nodes):
            due = base + i * REPORT_INTERVAL_S / nodes
            if due >= end:
                break
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(i, cycle, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        cycle += 1
    if tasks:
        await asyncio.wait(tasks, timeout=60)
    offered = nodes / REPORT_INTERVAL_S * duration_s
    latencies.sort()
    return {
        "nodes": nodes,
        "offered_per_s": nodes / REPORT_INTERVAL_S,
        "answered_per_s": answered / duration_s,
        "keep_up_ratio": answered / offered if offered else 0.0,
        "failures": failures,
        "p50_ms": _pct(latencies, 0.50),
        "p99_ms": _pct(latencies, 0.99),
        "max_ms": latencies[-1] if latencies else float("nan"),
    }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def loadgen_main(args: argparse.Namespace) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(
        _drive(args.url, args.nodes, args.duration, args.warmup, args.path, args.pool)
    )
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------- orchestration


@dataclass
class Level:
    nodes: int
    offered_per_s: float
    answered_per_s: float
    keep_up_ratio: float
    failures: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu_ms_per_report: float
    kept_up: bool


class _Controller:
    """The controller under test, a process of its own."""

    def __init__(self, database_url: str, log_dir: Path) -> None:
        env = {
            **os.environ,
            "TRAINGUARD_DATABASE_URL": database_url,
            "TRAINGUARD_PORT": "0",
            "TRAINGUARD_LOG_LEVEL": "warning",
            "TRAINGUARD_NODE_LOST_AFTER_S": "3600",
            "TRAINGUARD_TOKENS": json.dumps([{"name": "bench", "role": "agent", "token": TOKEN}]),
            # One agent token for every simulated node (the controller's default is off).
            "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",
        }
        code = (
            "import logging, sys\n"
            "from controller.server import serve\n"
            "from controller.settings import ControllerSettings\n"
            "logging.basicConfig(stream=sys.stderr)\n"
            "serve(ControllerSettings(log_level='info'))\n"
        )
        self.log = open(log_dir / "controller.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stderr is not None
        self.url = ""
        for line in self.proc.stderr:
            if '"controller listening"' in line:
                self.url = json.loads(line)["url"]
                break
        if not self.url:
            raise RuntimeError("controller did not start; see its stderr")
        # Keep draining stderr so the controller never blocks on a full pipe.
        import threading

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.write(line)

        threading.Thread(target=drain, daemon=True).start()
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("controller not ready after 30 s")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _run_loadgen(
    url: str, nodes: int, duration_s: float, warmup_s: float, path: str
) -> dict[str, Any]:
    pool = max(16, min(256, nodes // 8))
    cmd = [
        sys.executable, "-m", "bench.ingest", "--loadgen", "--url", url,
        "--nodes", str(nodes), "--duration", str(duration_s), "--warmup", str(warmup_s),
        "--path", path, "--pool", str(pool),
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _levels(quick: bool) -> list[int]:
    if quick:
        return list(CURVE_LEVELS)
    return [256, 512, 1024, 2048, 2560, 3072, 4096, 6144, 8192]


def bench_backend(
    name: str, database_url: str, *, quick: bool, log_dir: Path
) -> tuple[list[Level], dict[str, Any]]:
    # One full report interval of warm-up: every node's first report (which registers the
    # node and its GPUs) falls before the measured window.
    duration, warmup = (5.0, REPORT_INTERVAL_S) if quick else (20.0, REPORT_INTERVAL_S)
    controller = _Controller(database_url, log_dir)
    levels: list[Level] = []
    floor: dict[str, Any] = {}
    failed = False
    try:
        for nodes in _levels(quick):
            if failed and nodes not in CURVE_LEVELS:
                continue  # past the first failure only the latency curve's levels still run
            cpu0 = controller.cpu_s()
            raw = _run_loadgen(controller.url, nodes, duration, warmup, "/api/v1/reports")
            cpu = controller.cpu_s() - cpu0
            reports = raw["answered_per_s"] * duration
            kept = (
                raw["keep_up_ratio"] >= KEEP_UP_RATIO
                and raw["failures"] == 0
                and raw["p99_ms"] < P99_TARGET_MS
            )
            level = Level(
                **raw,
                cpu_ms_per_report=1000 * cpu / reports if reports else float("nan"),
                kept_up=kept,
            )
            levels.append(level)
            print(_row(name, level), file=sys.stderr, flush=True)
            failed = failed or not kept
            if failed and nodes >= max(CURVE_LEVELS):
                break
        top = max(lv.nodes for lv in levels)
        floor = _run_loadgen(controller.url, top, duration, warmup, "/healthz")
    finally:
        controller.stop()
    return levels, floor


def _row(name: str, lv: Level) -> str:
    return (
        f"{name:<9} {lv.nodes:>6} {lv.nodes * GPUS:>7} {lv.offered_per_s:>9.1f} "
        f"{lv.answered_per_s:>9.1f} {lv.p50_ms:>8.1f} {lv.p99_ms:>8.1f} {lv.max_ms:>8.1f} "
        f"{lv.cpu_ms_per_report:>7.2f} {'yes' if lv.kept_up else 'NO':>5}"
    )


HEADER = (
    f"{'BACKEND':<9} {'NODES':>6} {'GPUS':>7} {'OFFER/S':>9} {'DONE/S':>9} {'P50_MS':>8} "
    f"{'P99_MS':>8} {'MAX_MS':>8} {'CPU_MS':>7} {'OK':>5}"
)


def _pg_database() -> tuple[str, str, Any]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(PG_SERVER).set(drivername="postgresql")
    name = f"trainguard_bench_{secrets.token_hex(4)}"
    conn = psycopg.connect(
        admin.render_as_string(hide_password=False), autocommit=True, connect_timeout=10
    )
    conn.execute(f'CREATE DATABASE "{name}"')
    url = admin.set(drivername="postgresql+psycopg", database=name)
    return url.render_as_string(hide_password=False), name, conn


def best_level(levels: list[Level]) -> Level | None:
    """The largest level below the first that failed (levels in the order they ran)."""
    best = None
    for level in sorted(levels, key=lambda lv: lv.nodes):
        if not level.kept_up:
            break
        best = level
    return best


def not_measured(reason: str) -> dict[str, Any]:
    """A backend's summary when it could not be measured: explicit, never left out."""
    return {"error": reason, "max_nodes": None, "gpu_samples_per_s": None, "p99_ms": None}


def summarize(levels: list[Level]) -> dict[str, Any]:
    best = best_level(levels)
    return {
        "max_nodes": best.nodes if best else 0,
        "gpu_samples_per_s": round(best.answered_per_s * SAMPLES * GPUS, 1) if best else 0.0,
        "p99_ms": round(best.p99_ms, 2) if best else None,
        "curve": {
            str(lv.nodes): {"p50_ms": round(lv.p50_ms, 2), "p99_ms": round(lv.p99_ms, 2)}
            for lv in levels
            if lv.nodes in CURVE_LEVELS
        },
        "cpu_ms_per_report": round(statistics.median(lv.cpu_ms_per_report for lv in levels), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ingest", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="5-s levels at 256/1,024/2,048 nodes (~45 s a backend)"
    )
    parser.add_argument("--json", action="store_true", help="last stdout line is a JSON summary")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="/api/v1/reports", help=argparse.SUPPRESS)
    parser.add_argument("--pool", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loadgen:
        loadgen_main(args)
        return 0

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        if backend not in ("sqlite", "postgres"):
            parser.error(f"unknown backend {backend!r} (sqlite, postgres)")
    summary: dict[str, Any] = {}
    print(HEADER, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        for backend in backends:
            summary[backend] = measure(backend, quick=args.quick, tmp=Path(tmp))
    if args.json:
        print(json.dumps(summary))
    return 0


def measure(backend: str, *, quick: bool, tmp: Path) -> dict[str, Any]:
    """One backend's levels (printed as table rows) and its summary."""
    if backend == "sqlite":
        levels, floor = bench_backend(
            "sqlite", f"sqlite:///{tmp}/bench.db", quick=quick, log_dir=tmp
        )
    else:
        from controller.db.migrate import upgrade

        try:
            url, name, admin = _pg_database()
        except Exception as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            reason = f"PostgreSQL at {_redacted(PG_SERVER)} unavailable: {detail}"
            print(f"{backend:<9} not measured: {reason}")
            print(f"{backend}: no result (set TRAINGUARD_TEST_PG to a reachable server)")
            return not_measured(reason)
        try:
            upgrade(url)
            levels, floor = bench_backend("postgres", url, quick=quick, log_dir=tmp)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.close()
    result = summarize(levels)
    result["healthz_floor"] = {
        "nodes": floor.get("nodes"),
        "p50_ms": round(floor.get("p50_ms", float("nan")), 2),
        "p99_ms": round(floor.get("p99_ms", float("nan")), 2),
    }
    top = next((lv for lv in levels if lv.nodes == floor.get("nodes")), None)
    if top is not None and floor.get("p50_ms"):
        result["p50_vs_healthz"] = round(top.p50_ms / floor["p50_ms"], 2)
    print("\n".join(_row(backend, lv) for lv in levels))
    print(
        f"{backend}: max {result['max_nodes']} nodes x {GPUS} GPUs = "
        f"{result['gpu_samples_per_s']:.0f} GPU samples/s, p99 {result['p99_ms']} ms; "
        f"HTTP floor (GET /healthz, same rate) p50 {result['healthz_floor']['p50_ms']} ms"
    )
    return result


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    raise SystemExit(main())
