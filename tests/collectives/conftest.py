"""Fixtures for the collectives tests: a real Unix-socket agent stand-in and a rank launcher.

The agent stand-in speaks the real framing (``trainguard.framing``) and validates every
frame with the real wire models, so the job-side client is exercised exactly as the node
agent will exercise it; it records what arrived and hands out commands on request.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.zygote import Zygote, ZygoteProcess
from trainguard.framing import FrameError, encode_frame, read_frame
from trainguard.wire import (
    Command,
    InflightCollective,
    JobRecords,
    LocalHello,
    LocalRecords,
    LocalReply,
    ProbeResult,
    RankEvent,
    StepSummary,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("rank_worker.py")


@dataclass
class Conn:
    hello: LocalHello
    frames: int = 0
    max_step: int = -1
    delivered: set[str] = field(default_factory=set)


class FakeAgent:
    """A threaded Unix-socket server that records hellos and job records per rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.hellos: list[LocalHello] = []
        self.batches: list[tuple[int, JobRecords]] = []
        self.frames_before_hello = 0
        #: Commands for every connection; each with the lowest step that must be seen first.
        self.commands: list[tuple[int, Command]] = []
        self.silent = False  # accept but never answer (a wedged agent)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(64)
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self.lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self.lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state: Conn | None = None
        try:
            while True:
                payload = read_frame(conn)
                if state is None:
                    hello = LocalHello.model_validate_json(payload)
                    state = Conn(hello)
                    with self.lock:
                        self.hellos.append(hello)
                else:
                    records = LocalRecords.model_validate_json(payload).records
                    state.frames += 1
                    for s in records.steps:
                        state.max_step = max(state.max_step, s.step)
                    with self.lock:
                        self.batches.append((state.hello.rank, records))
                if self.silent:
                    continue
                conn.sendall(encode_frame(self._reply(state).model_dump_json().encode()))
        except (FrameError, OSError):
            pass
        finally:
            conn.close()

    def _reply(self, state: Conn) -> LocalReply:
        with self.lock:
            due = [
                cmd
                for after, cmd in self.commands
                if state.max_step >= after and cmd.id not in state.delivered
            ]
        state.delivered.update(cmd.id for cmd in due)
        return LocalReply(commands=due)

    # ------------------------------------------------------------------ queries

    def records(self, rank: int | None = None) -> list[tuple[int, JobRecords]]:
        with self.lock:
            return [(r, b) for r, b in self.batches if rank is None or r == rank]

    def steps(self) -> dict[tuple[int, int], StepSummary]:
        return {(s.rank, s.step): s for _, b in self.records() for s in b.steps}

    def inflight(self) -> list[InflightCollective]:
        return [x for _, b in self.records() for x in b.inflight]

    def events(self) -> list[RankEvent]:
        return [x for _, b in self.records() for x in b.rank_events]

    def probes(self) -> list[ProbeResult]:
        return [x for _, b in self.records() for x in b.probes]

    def wait_for(self, predicate: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        return predicate()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: Unix socket paths are limited to ~107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tgc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def collectives_agent(short_dir: Path) -> Iterator[FakeAgent]:
    agent = FakeAgent(str(short_dir / "agent.sock"))
    yield agent
    agent.close()


@dataclass
class Ranks:
    procs: list[ZygoteProcess]
    out_dir: Path

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=10)

    def stderr(self, rank: int) -> str:
        return (self.out_dir / f"stderr{rank}.txt").read_text()

    def results(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait for every rank to exit 0 without a traceback (else fail with their stderr's
        tails), then each rank's ``rank<N>.json``; no rank outlives the call."""
        try:
            codes = self.wait(timeout_s)
            assert codes == [0] * len(self.procs), "\n".join(
                f"--- rank {r} exited {c}:\n{self.stderr(r)[-4000:]}"
                for r, c in enumerate(codes)
                if c != 0
            )
        finally:
            self.kill()
        for r in range(len(self.procs)):
            assert "Traceback" not in self.stderr(r), self.stderr(r)[-4000:]
        return [
            json.loads((self.out_dir / f"rank{r}.json").read_text()) for r in range(len(self.procs))
        ]


def launch_ranks(
    zygote: Zygote,
    scenario: str,
    world_size: int,
    out_dir: Path,
    *,
    socket_path: str,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    worker: Path = WORKER,
) -> Ranks:
    """Start ``world_size`` rank processes (torchrun-like env, file store, gloo on loopback),
    each ``python worker scenario out_dir`` forked from the session's torch zygote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "store"
    procs = []
    for rank in range(world_size):
        child_env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "TG_STORE": str(store),
            "GLOO_SOCKET_IFNAME": "lo",
            "TRAINGUARD_JOB": "test-job",
            "TRAINGUARD_AGENT_SOCKET": socket_path,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
            **((rank_env or {}).get(rank, {})),
        }
        stderr = out_dir / f"stderr{rank}.txt"
        stderr.write_text("")
        procs.append(
            zygote.spawn(
                [str(worker), scenario, str(out_dir)], env=child_env, stdout=stderr, cwd=ROOT
            )
        )
    return Ranks(procs, out_dir)


@pytest.fixture
def rank_launcher(torch_zygote: Zygote) -> Callable[..., Ranks]:
    return functools.partial(launch_ranks, torch_zygote)


@pytest.fixture
def single_rank(tmp_path: Path) -> Iterator[None]:
    """torch.distributed with one gloo rank in this process (fast; no spawn)."""
    import torch.distributed as dist

    import collectives

    assert not dist.is_initialized(), "a previous test left torch.distributed initialized"
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        collectives.uninstrument()
        dist.destroy_process_group()


@pytest.fixture
def agent_factory() -> Iterator[Callable[[str], FakeAgent]]:
    """Start agents on demand (late, or one after another on the same path)."""
    started: list[FakeAgent] = []

    def start(path: str) -> FakeAgent:
        agent = FakeAgent(path)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.close()
