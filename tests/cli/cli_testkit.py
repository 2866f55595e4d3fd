"""Shared pieces of the CLI tests: the controller handle, the reports fed to it, results."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests import http_calls
from trainguard import wire

FAULTY_NODE, FAULTY_GPU = "node-b", 3
NODES = ("node-a", "node-b", "node-c")
JOB = "train-1"


@dataclass(frozen=True, slots=True)
class CliServer:
    url: str
    viewer_token: str
    agent_token: str

    def get(self, path: str, **params: object) -> object:
        reply = http_calls.get(
            f"{self.url}{wire.API_PREFIX}{path}",
            params={k: v for k, v in params.items() if v is not None},
            headers={"Authorization": f"Bearer {self.viewer_token}"},
        )
        reply.raise_for_status()
        return reply.json()


def _report(node: str, seq: int, instance: str) -> wire.Report:
    now = time.time()
    gpus = [
        wire.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3")
        for i in range(8)
    ]
    samples = []
    for tick in range(2):
        gpu_samples = []
        for i in range(8):
            xids = []
            if node == FAULTY_NODE and i == FAULTY_GPU and seq == 1 and tick == 1:
                xids = [wire.XidEvent(code=79, time_unix_s=now, gpu_index=i)]
            gpu_samples.append(
                wire.GpuSample(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    power_w=300.0 + i,
                    temperature_c=55.0,
                    sm_clock_mhz=1980,
                    utilization_gpu_pct=90.0,
                    memory_used_bytes=40 << 30,
                    memory_total_bytes=80 << 30,
                    xid_events=xids,
                )
            )
        samples.append(
            wire.NodeSample(time_unix_s=now - 1 + tick * 0.5, gpus=gpu_samples, node_power_w=2500.0)
        )
    steps = [
        wire.StepSummary(
            job=JOB,
            rank=NODES.index(node),
            world_size=len(NODES),
            step=seq,
            step_time_s=1.0,
            compute_time_s=0.8,
            collective_wait_s=0.2,
            gpu_index=0,
            end_unix_s=now,
        )
    ]
    return wire.Report(
        node=wire.NodeIdentity(
            name=node,
            hostname=f"{node}.test",
            gpus=gpus,
            backend="sim",
            agent_version="0.1.0",
            labels={"rack": "r1"},
        ),
        agent_instance=instance,
        seq=seq,
        sent_unix_s=now,
        sample_interval_s=0.5,
        samples=samples,
        job=wire.JobRecords(steps=steps),
    )


def feed(server: CliServer) -> None:
    headers = {"Authorization": f"Bearer {server.agent_token}"}
    for node in NODES:
        instance = secrets.token_hex(8)
        for seq in range(3):
            body = _report(node, seq, instance).model_dump_json()
            reply = http_calls.post(
                f"{server.url}{wire.API_PREFIX}/reports",
                content=body,
                headers=headers | {"Content-Type": "application/json"},
            )
            assert reply.status_code == 200, reply.text


def controller_ready(url: str) -> bool:
    try:
        return http_calls.get(f"{url}/readyz").status_code == 200
    except httpx.TransportError:
        return False


def has_incident(server: CliServer) -> bool:
    page = server.get("/incidents", state="open")
    return isinstance(page, dict) and page.get("count", 0) > 0


@dataclass(frozen=True, slots=True)
class CliResult:
    code: int
    out: str
    err: str


#: More actions than one API page (500), so the CLI must walk pages to show them all.
SEEDED_ACTIONS = 510


def seed_actions(database_url: str) -> None:
    """Actions as the policy engine will record them (no code path creates them yet).

    Written straight into the controller's database, which the API reads on every request.
    """
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from controller.db.models import Action

    now = time.time()
    engine = create_engine(database_url)
    with Session(engine) as session, session.begin():
        for i in range(SEEDED_ACTIONS):
            done = i % 3 != 0
            session.add(
                Action(
                    kind="cordon_node" if i % 2 else "protective_checkpoint",
                    target=f"node/{FAULTY_NODE}" if i % 2 else f"job/{JOB}",
                    trigger=f"incident:{i + 1}",
                    params={"gpu": FAULTY_GPU, "reason": "xid 79"},
                    status="succeeded" if done else "pending",
                    outcome="node cordoned" if done else "",
                    created_unix_s=now - 3600 + i,
                    finished_unix_s=now - 3590 + i if done else None,
                )
            )
    engine.dispose()


@dataclass
class Canned:
    """What a stand-in controller answers every request with, and the requests it saw
    (``"GET /api/v1/nodes?..."``). ``body``: bytes as they are, anything else as JSON."""

    status: int = 200
    body: Any = b"{}"
    content_type: str = "application/json"
    seen: list[str] = field(default_factory=list)


@contextmanager
def canned_server() -> Iterator[tuple[str, Canned]]:
    """A local HTTP server answering every request with one ``Canned`` reply (no
    controller): for what a broken, hostile or older server can make the CLI print."""
    canned = Canned()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            canned.seen.append(f"{self.command} {self.path}")
            body = canned.body
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(canned.status)
            self.send_header("content-type", canned.content_type)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PUT = _answer

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", canned
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped (PID 1 in containers may not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status
