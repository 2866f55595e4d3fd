"""Test helpers for the agent: a small real controller stand-in, a local-socket client, and
an agent running on a thread of its own (:class:`Running`).

``FakeController`` is a FastAPI app served by uvicorn on an ephemeral 127.0.0.1 port. It
checks the bearer token, validates reports with the real wire models, de-duplicates by
(node, agent_instance, seq) as the controller does, hands out queued commands, and can be
told to answer 503/429/422 for the next N posts, to stall past the agent's timeout, or to
go down and come back on the same port (connections refused in between).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agents.daemon import Agent
from agents.settings import AgentSettings, load_settings
from trainguard.framing import encode_frame, read_frame
from trainguard.wire import (
    API_PREFIX,
    JobRecords,
    LocalHello,
    LocalRecords,
    LocalReply,
    Report,
    ReportReply,
)

TOKEN = "agent-token-0123456789abcdef"


@dataclass
class ControllerState:
    reports: dict[tuple[str, str, int], Report] = field(default_factory=dict)
    posts: int = 0
    duplicates: int = 0
    post_times: list[float] = field(default_factory=list)
    fail_next: deque[tuple[int, dict[str, str]]] = field(default_factory=deque)
    stall_s: float = 0.0
    commands: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: When each command id was first handed out, and when its first ack arrived (monotonic).
    delivered_at: dict[str, float] = field(default_factory=dict)
    acked_at: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ordered(self) -> list[Report]:
        with self.lock:
            return [self.reports[k] for k in sorted(self.reports, key=lambda k: (k[1], k[2]))]


def make_app(state: ControllerState) -> FastAPI:
    app = FastAPI()

    @app.post(f"{API_PREFIX}/reports")
    async def post_report(request: Request) -> JSONResponse:
        with state.lock:
            state.posts += 1
            state.post_times.append(time.monotonic())
            failure = state.fail_next.popleft() if state.fail_next else None
            stall = state.stall_s
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"detail": "unknown token"}, status_code=401)
        body = await request.body()
        if failure is not None:
            status, headers = failure
            return JSONResponse({"detail": f"told to fail with {status}"}, status, headers=headers)
        try:
            report = Report.model_validate_json(body)
        except ValueError as exc:
            return JSONResponse({"detail": str(exc).splitlines()[0]}, status_code=422)
        key = (report.node.name, report.agent_instance, report.seq)
        with state.lock:
            duplicate = key in state.reports
            if duplicate:
                state.duplicates += 1
            else:
                state.reports[key] = report
            commands = state.commands.pop(report.node.name, [])
            now = time.monotonic()
            for command in commands:
                state.delivered_at.setdefault(str(command.get("id")), now)
            for ack in report.command_acks:
                state.acked_at.setdefault(ack.command_id, now)
        if stall:  # stored, but the answer comes too late: the agent's ack is "lost"
            await asyncio.sleep(stall)
        reply = ReportReply(seq=report.seq, duplicate=duplicate, server_unix_s=time.time())
        answer = reply.model_dump(mode="json")
        answer["commands"] = commands
        return JSONResponse(answer)

    return app


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test process keeps its own handlers
        pass


class FakeController:
    def __init__(self) -> None:
        self.state = ControllerState()
        self.port = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off")
        self._server = _Server(config)
        server = self._server
        self._thread = threading.Thread(
            target=lambda: server.run(sockets=[sock]), name="fake-controller", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake controller did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None

    def queue_command(self, node: str, command: dict[str, Any]) -> None:
        with self.state.lock:
            self.state.commands.setdefault(node, []).append(command)

    def fail(self, status: int, times: int = 1, headers: dict[str, str] | None = None) -> None:
        with self.state.lock:
            for _ in range(times):
                self.state.fail_next.append((status, headers or {}))

    def wait_for(self, predicate: Any, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; {len(self.state.reports)} reports stored")
            time.sleep(0.02)


class LocalClient:
    """Blocking job-side client for the agent socket (the real one lives in collectives)."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)

    def send_raw(self, payload: bytes) -> LocalReply:
        self.sock.sendall(encode_frame(payload))
        return self.read_reply()

    def read_reply(self) -> LocalReply:
        return LocalReply.model_validate_json(read_frame(self.sock))

    def hello(self, job: str, rank: int, world_size: int = 2, pid: int = 1) -> LocalReply:
        msg = LocalHello(job=job, rank=rank, world_size=world_size, pid=pid)
        return self.send_raw(msg.model_dump_json().encode())

    def records(self, records: JobRecords) -> LocalReply:
        return self.send_raw(LocalRecords(records=records).model_dump_json().encode())

    def send_json(self, obj: Any) -> LocalReply:
        return self.send_raw(json.dumps(obj).encode())

    def close(self) -> None:
        self.sock.close()


class Running:
    """``with Running(agent):`` the agent started, its loop on a thread; stopped on exit."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.stop = threading.Event()
        self.thread = threading.Thread(target=agent.run_until, args=(self.stop,), daemon=True)

    def __enter__(self) -> Agent:
        self.agent.start()
        self.thread.start()
        return self.agent

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.agent.stop()


def quiet_agent_settings(tmp: Path, url: str, **extra: Any) -> AgentSettings:
    """An in-process agent that touches nothing of this machine: a fast cadence, its spool
    under ``tmp``, no socket, no metrics port, no powercap or sysfs of the host, in the
    background, no preflight load. ``extra`` overrides any of these."""
    values: dict[str, Any] = dict(
        controller_url=url, token=TOKEN, node_name="gpu-node-5", gpus="sim:4",
        sample_interval_s=0.05, report_interval_s=0.2, spool_dir=tmp / "spool", socket_path="",
        metrics_port=-1, powercap_dir=tmp / "no-powercap", sysfs_root=tmp / "no-sys",
        foreground=False, preflight_load=False,
    )  # fmt: skip
    return load_settings(**(values | extra))
