"""Real processes for the end-to-end tests: a controller, agents, and a report tap.

The tap is a tiny HTTP forwarder between the agents and the controller. It records every
report an agent *put on the wire* (node, agent instance, seq, its samples' timestamps),
whether or not the controller was there to take it. That gives an account of what the
agents produced that does not depend on the controller under test, so "nothing lost,
nothing counted twice" can be asserted exactly.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests import http_calls
from tests.environ import clean_env
from trainguard.cli.client import ApiClient
from trainguard.cli.procs import Child, ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

SAMPLE_S = 0.2
REPORT_S = 0.5


@dataclass(slots=True)
class SentReport:
    node: str
    instance: str
    seq: int
    sample_times: tuple[float, ...]
    statuses: list[int] = field(default_factory=list)


class ReportTap:
    """Forward ``/api/v1/*`` to ``upstream`` and remember each report by (node, instance, seq)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.reports: dict[tuple[str, str, int], SentReport] = {}
        self._lock = threading.Lock()
        self._http = http_calls.client(timeout=10.0)
        tap = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                record = tap._remember(self.path, body)
                try:
                    reply = tap._http.post(
                        tap.upstream + self.path,
                        content=body,
                        headers={
                            k: v
                            for k, v in self.headers.items()
                            if k.lower() in ("authorization", "content-type")
                        },
                    )
                    status, data = reply.status_code, reply.content
                except httpx.TransportError:
                    status, data = 502, b'{"detail": "tap: controller unreachable"}'
                if record is not None:
                    with tap._lock:
                        record.statuses.append(status)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    def _remember(self, path: str, body: bytes) -> SentReport | None:
        if not path.endswith("/reports"):
            return None
        report = json.loads(body)
        key = (report["node"]["name"], report["agent_instance"], int(report["seq"]))
        times = tuple(float(s["time_unix_s"]) for s in report.get("samples", []))
        with self._lock:
            known = self.reports.get(key)
            if known is None:
                known = self.reports[key] = SentReport(*key, sample_times=times)
            assert known.sample_times == times, f"report {key} changed between retries"
            return known

    def of_node(self, node: str) -> list[SentReport]:
        with self._lock:
            return sorted((r for r in self.reports.values() if r.node == node), key=lambda r: r.seq)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()


class E2ECluster:
    """One controller (restartable on the same port and database) and named agents."""

    def __init__(self, workdir: Path, database_url: str, *, node_lost_after_s: float = 60.0):
        self.workdir = workdir
        self.database_url = database_url
        self.node_lost_after_s = node_lost_after_s
        self.procs = ProcessSet(workdir / "logs")
        self.port = free_port()
        self.server = f"http://127.0.0.1:{self.port}"
        self.agent_token = secrets.token_urlsafe(24)
        self.viewer_token = secrets.token_urlsafe(24)
        self.operator_token = secrets.token_urlsafe(24)
        self.tap = ReportTap(self.server)

    def close(self) -> None:
        self.procs.stop_all()
        self.tap.close()

    def api(self) -> ApiClient:
        return ApiClient(self.server, self.viewer_token)

    def upgrade_database(self) -> None:
        """``trainguard db upgrade``: PostgreSQL is never migrated implicitly."""
        done = subprocess.run(
            cli_argv("db", "upgrade", "--database-url", self.database_url),
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

    def start_controller(self, extra_env: dict[str, str] | None = None) -> Child:
        tokens = [
            {"name": "e2e-agent", "role": "agent", "token": self.agent_token},
            {"name": "e2e-viewer", "role": "viewer", "token": self.viewer_token},
            {"name": "e2e-operator", "role": "operator", "token": self.operator_token},
        ]
        env = {
            "TRAINGUARD_TOKENS": json.dumps(tokens),
            # One agent token for every node of the test cluster (the default is off).
            "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",
            "TRAINGUARD_NODE_LOST_AFTER_S": str(self.node_lost_after_s),
            **(extra_env or {}),
        }
        argv = cli_argv(
            *("controller", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--database-url", self.database_url),
        )
        child = self.procs.start("controller", argv, env=clean_env(env))
        with ApiClient(self.server) as probe:
            ok = wait_until(lambda: probe.ready() or not child.alive(), timeout_s=60)
            if not (ok and child.alive() and probe.ready()):
                raise AssertionError(f"controller did not start:\n{child.log_tail(40)}")
        return child

    def spool_dir(self, node: str) -> Path:
        return self.workdir / node / "spool"

    def start_agent(self, node: str, *, faults: Iterable[str] = ()) -> Child:
        argv = cli_argv(
            *("agent", "--controller", self.tap.url, "--token", self.agent_token),
            *("--node-name", node, "--gpus", "sim:8", "--spool-dir", str(self.spool_dir(node))),
            *("--socket-path", "", "--metrics-port", "-1"),
            *("--sample-interval", str(SAMPLE_S), "--report-interval", str(REPORT_S)),
        )
        for spec in faults:
            argv += ["--sim-fault", spec]
        # Retry quickly after an outage so the test does not wait out a 30 s backoff.
        return self.procs.start(
            node, argv, env=clean_env({"TRAINGUARD_AGENT_BACKOFF_MAX_S": "0.5"})
        )

    def wait(self, what: str, predicate: Any, timeout_s: float = 40.0) -> None:
        if not wait_until(predicate, timeout_s=timeout_s, interval_s=0.1):
            logs = "\n".join(
                f"--- {c.name}\n{c.log_tail(15)}" for c in self.procs.children.values()
            )
            raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def acked_reports(self, node: str) -> int:
        return sum(1 for r in self.tap.of_node(node) if 200 in r.statuses)

    def stored_samples(self, node: str) -> int:
        """NodeSamples the controller stored for ``node`` (its GPU 0 history, summed)."""
        with self.api() as api:
            detail = api.node(node, history_s=24 * 3600)
        return sum(p["samples"] for p in detail["history"] if p["gpu_index"] == 0)


def spool_leftovers(spool: Path) -> tuple[str, int, set[int], list[float]]:
    """(agent_instance, next_seq, unsent report seqs, journaled sample times) of a spool."""
    state = json.loads((spool / "state.json").read_text())
    unsent = {
        int(p.stem) for p in (spool / "reports").iterdir() if re.fullmatch(r"\d{12}\.json", p.name)
    }
    next_seq = max([int(state["next_seq"]), *(seq + 1 for seq in unsent)])
    journal: list[float] = []
    for path in sorted((spool / "journal").glob("pending-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn last line: that sample was never fully produced
            if entry.get("t") == "sample":
                journal.append(float(entry["v"]["time_unix_s"]))
    return state["agent_instance"], next_seq, unsent, journal


def unsent_sample_times(spool: Path, seqs: Iterable[int]) -> list[float]:
    times: list[float] = []
    for seq in seqs:
        report = json.loads((spool / "reports" / f"{seq:012d}.json").read_text())
        times += [float(s["time_unix_s"]) for s in report.get("samples", [])]
    return times


def now() -> float:
    return time.time()
