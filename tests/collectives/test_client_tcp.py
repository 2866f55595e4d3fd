"""Ranks reach the real agent endpoint over TCP on 127.0.0.1 with a job token.

The server is the agent's own :class:`agents.local_endpoint.LocalEndpoint` with its TCP
listener (no Unix socket at all, as in a Pod Security ``baseline`` namespace); the client is
the real job-side :class:`collectives.client.AgentClient`, in this process and in two real
gloo rank processes that find the agent from ``TRAINGUARD_AGENT_ADDR`` and
``TRAINGUARD_AGENT_TOKEN_FILE`` as the example manifests set them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.local_endpoint import LocalEndpoint, Session
from agents.tcp_endpoint import TcpListen
from collectives.client import AgentClient
from collectives.config import InstrumentConfig, config_from_env
from collectives.errors import CollectivesConfigError
from collectives.outbox import Outbox
from trainguard.wire import Command, JobCheckpoint, JobRecords, LocalHello, StepSummary

GOOD = "job-token-0f3a9c1e5b7d2468"
WRONG = "job-token-ffffffffffffffff"


class Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple[str, JobRecords]] = []
        self.hellos: list[LocalHello] = []

    def __call__(self, session: Session, records: JobRecords, size: int) -> None:
        assert session.hello is not None
        with self.lock:
            self.records.append((session.hello.job, records))
            self.hellos.append(session.hello)

    def steps(self, job: str) -> list[StepSummary]:
        with self.lock:
            return [s for j, r in self.records if j == job for s in r.steps]


@pytest.fixture
def tcp_agent(tmp_path: Path) -> Iterator[tuple[LocalEndpoint, Sink, Path]]:
    token_file = tmp_path / "agent-tokens"
    token_file.write_text(GOOD + "\n")
    sink = Sink()
    ep = LocalEndpoint(
        None,
        on_records=sink,
        tcp=TcpListen(host="127.0.0.1", port=0, token_file=token_file),
    )
    ep.start()
    try:
        yield ep, sink, token_file
    finally:
        ep.stop()


def _addr(ep: LocalEndpoint) -> str:
    assert ep.tcp_address is not None
    host, port = ep.tcp_address
    return f"{host}:{port}"


def _client(ep: LocalEndpoint, token_file: Path, got: list[Command]) -> tuple[AgentClient, Outbox]:
    cfg = InstrumentConfig(
        job="j",
        agent_addr=_addr(ep),
        agent_token_file=str(token_file),
        ship_interval_s=0.05,
        connect_backoff_max_s=0.2,
    )
    box = Outbox(1000)
    hello = LocalHello(job="j", rank=1, world_size=2, pid=4321)
    return AgentClient(cfg, hello, box, got.extend), box


def _wait(predicate: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def _step(i: int) -> StepSummary:
    return StepSummary(
        job="j", rank=1, world_size=2, step=i, step_time_s=0.2, compute_time_s=0.15,
        collective_wait_s=0.05,
    )  # fmt: skip


def test_good_token_ships_records_and_gets_commands(
    tcp_agent: tuple[LocalEndpoint, Sink, Path],
) -> None:
    ep, sink, token_file = tcp_agent
    got: list[Command] = []
    client, box = _client(ep, token_file, got)
    client.start()
    try:
        box.add_step(_step(0))
        _wait(lambda: sink.steps("j"))
        assert ep.enqueue(JobCheckpoint(id="c1", job="j", at_step=5)) == 1
        _wait(lambda: got)
        assert [c.id for c in got] == ["c1"]
        (session,) = [s for s in ep.sessions() if s.disconnected_unix_s is None]
        assert session.transport == "tcp" and session.peer_addr.startswith("127.0.0.1:")
        assert session.hello is not None and session.hello.token == ""  # never kept
    finally:
        client.stop()
    assert all(h.token == "" for h in sink.hellos)


def test_wrong_token_is_refused_clearly_and_never_logged(
    tcp_agent: tuple[LocalEndpoint, Sink, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ep, sink, _ = tcp_agent
    bad = tmp_path / "wrong-token"
    bad.write_text(WRONG)
    got: list[Command] = []
    client, box = _client(ep, bad, got)
    caplog.set_level(logging.DEBUG)
    client.start()
    try:
        box.add_step(_step(0))
        _wait(lambda: client.connect_failures >= 2)
        assert not client.connected and sink.records == []
    finally:
        client.stop(flush_timeout_s=0.2)
    refusals = [
        r.getMessage() for r in caplog.records if r.name == "trainguard.collectives"
        and r.levelno == logging.WARNING
    ]  # fmt: skip
    assert len(refusals) == 1, refusals  # said once, then retried quietly
    assert "refused this rank" in refusals[0] and "job token is wrong" in refusals[0]
    assert "TRAINGUARD_AGENT_TOKEN_FILE" in refusals[0]
    closed = [s for s in ep.sessions() if s.disconnected_unix_s is not None]
    assert closed and all(s.close_reason.startswith("not authenticated") for s in closed)
    assert all(s.hello is None for s in closed)
    assert not any(WRONG in r.getMessage() or GOOD in r.getMessage() for r in caplog.records)


def test_rotated_token_file_lets_the_old_and_new_token_in(
    tcp_agent: tuple[LocalEndpoint, Sink, Path], tmp_path: Path
) -> None:
    ep, sink, token_file = tcp_agent
    new = "job-token-new-77aa55cc33ee"
    token_file.write_text(f"{GOOD}\n{new}\n")  # the Secret during a rotation
    mine = tmp_path / "new-token"
    mine.write_text(new + "\n")
    client, box = _client(ep, mine, [])
    client.start()
    try:
        box.add_step(_step(0))
        _wait(lambda: sink.steps("j"))
    finally:
        client.stop()


def test_config_from_env_needs_a_token_file_with_an_address() -> None:
    cfg = config_from_env(
        env={
            "TRAINGUARD_JOB": "j",
            "TRAINGUARD_AGENT_ADDR": "10.0.3.7:9471",
            "TRAINGUARD_AGENT_TOKEN_FILE": "/var/run/trainguard/token",
        }
    )
    assert (cfg.agent_addr, cfg.agent_token_file) == ("10.0.3.7:9471", "/var/run/trainguard/token")
    with pytest.raises(CollectivesConfigError, match="needs agent_token_file"):
        config_from_env(env={"TRAINGUARD_JOB": "j", "TRAINGUARD_AGENT_ADDR": "10.0.3.7:9471"})
    with pytest.raises(CollectivesConfigError, match="not HOST:PORT"):
        InstrumentConfig(job="j", agent_addr="10.0.3.7", agent_token_file="/t")


@pytest.mark.slow
def test_real_rank_processes_report_over_tcp(
    tcp_agent: tuple[LocalEndpoint, Sink, Path],
    tmp_path: Path,
    rank_launcher: Callable[..., Any],
) -> None:
    ep, sink, token_file = tcp_agent
    ranks = rank_launcher(
        "loop",
        2,
        tmp_path / "out",
        socket_path="/nonexistent/agent.sock",  # the TCP address must win
        env={
            "TRAINGUARD_AGENT_ADDR": _addr(ep),
            "TRAINGUARD_AGENT_TOKEN_FILE": str(token_file),
            "TG_STEPS": "10",
        },
    )
    try:
        assert ranks.wait(60) == [0, 0], ranks.stderr(0) + ranks.stderr(1)
    finally:
        ranks.kill()
    steps = sink.steps("test-job")
    assert {(s.rank, s.step) for s in steps} >= {(r, i) for r in (0, 1) for i in range(9)}
    assert {s.transport for s in ep.sessions()} == {"tcp"}
