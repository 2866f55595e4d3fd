"""The agent's TCP endpoint for ranks: token check, bounds on unauthenticated peers, idle
timeout, settings. Raw sockets on 127.0.0.1 against the real endpoint (the real job-side
client over TCP is in tests/collectives/test_client_tcp.py)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import agents.local_endpoint as local_endpoint
from agents.daemon import Agent
from agents.errors import AgentConfigError, ListenError
from agents.local_endpoint import LocalEndpoint, Session
from agents.settings import load_settings
from agents.tcp_endpoint import HELLO_MAX_BYTES, JobTokens, TcpListen, parse_listen
from tests.agents.agents_testkit import FakeController
from tests.agents.test_daemon import Running
from tests.agents.test_daemon import settings as daemon_settings
from trainguard.framing import encode_frame, read_frame
from trainguard.wire import InflightCollective, JobRecords, LocalHello, LocalRecords, LocalReply

TOKEN = "job-token-5e8c1a2b9d4f7031"


def _noop(session: Session, records: JobRecords, size: int) -> None:
    return None


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(TOKEN + "\n")
    return path


def _endpoint(token_file: Path, **kw: float) -> LocalEndpoint:
    hello_timeout_s = kw.pop("hello_timeout_s", 5.0)
    ep = LocalEndpoint(
        None,
        on_records=_noop,
        tcp=TcpListen(
            host="127.0.0.1", port=0, token_file=token_file, hello_timeout_s=hello_timeout_s
        ),
        **kw,
    )
    ep.start()
    return ep


@pytest.fixture
def endpoint(token_file: Path) -> Iterator[LocalEndpoint]:
    ep = _endpoint(token_file)
    try:
        yield ep
    finally:
        ep.stop()


def _connect(ep: LocalEndpoint) -> socket.socket:
    assert ep.tcp_address is not None
    sock = socket.create_connection(ep.tcp_address, timeout=5)
    return sock


def _ask(sock: socket.socket, payload: bytes) -> LocalReply:
    sock.sendall(encode_frame(payload))
    return LocalReply.model_validate_json(read_frame(sock))


def _hello(token: str) -> bytes:
    return LocalHello(job="j", rank=0, world_size=1, pid=7, token=token).model_dump_json().encode()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_good_token_then_records(endpoint: LocalEndpoint) -> None:
    sock = _connect(endpoint)
    try:
        assert _ask(sock, _hello(TOKEN)).ok
        assert _ask(sock, LocalRecords().model_dump_json().encode()).ok
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (_hello(""), "authentication failed: the hello's job token is missing"),
        (_hello(TOKEN[:-1] + "X"), "authentication failed: the hello's job token is wrong"),
        (_hello(TOKEN + "X"), "authentication failed: the hello's job token is wrong"),
        (LocalRecords().model_dump_json().encode(), "send a hello frame before records"),
        (b"{not json", "invalid frame: not JSON"),
    ],
    ids=["missing", "wrong", "longer", "records-first", "garbage"],
)
def test_unauthenticated_peer_gets_one_answer_then_is_closed(
    endpoint: LocalEndpoint, payload: bytes, error: str
) -> None:
    sock = _connect(endpoint)
    try:
        reply = _ask(sock, payload)
        assert not reply.ok and reply.error.startswith(error)
        assert _closed(sock)
    finally:
        sock.close()
    assert all(TOKEN not in s.close_reason for s in endpoint.sessions())


def test_unauthenticated_peer_cannot_announce_a_big_frame(endpoint: LocalEndpoint) -> None:
    sock = _connect(endpoint)
    try:
        sock.sendall(struct.pack(">I", HELLO_MAX_BYTES + 1))
        reply = LocalReply.model_validate_json(read_frame(sock))
        assert (
            not reply.ok and "framing error" in reply.error and str(HELLO_MAX_BYTES) in reply.error
        )
        assert _closed(sock)
    finally:
        sock.close()


def test_silent_peers_are_closed_before_and_after_the_hello(token_file: Path) -> None:
    ep = _endpoint(token_file, hello_timeout_s=0.3, idle_timeout_s=0.5)
    quiet, idle = _connect(ep), _connect(ep)
    try:
        assert _ask(idle, _hello(TOKEN)).ok
        started = time.monotonic()
        reply = LocalReply.model_validate_json(read_frame(quiet))
        assert reply.error == "closing: no hello for 0.3 s"
        assert _closed(quiet)
        reply = LocalReply.model_validate_json(read_frame(idle))
        assert reply.error == "closing: no frame for 0.5 s"
        assert _closed(idle) and time.monotonic() - started < 3
    finally:
        quiet.close()
        idle.close()
        ep.stop()


def test_unauthenticated_seats_are_bounded(
    token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_endpoint, "MAX_UNAUTHENTICATED", 2)
    ep = _endpoint(token_file)
    waiting = [_connect(ep), _connect(ep)]
    time.sleep(0.3)  # both accepted and seated
    late = _connect(ep)
    try:
        reply = LocalReply.model_validate_json(read_frame(late))
        assert not reply.ok and "2 connections waiting for a hello" in reply.error
        assert _closed(late)
        assert _ask(waiting[0], _hello(TOKEN)).ok  # a seat frees once a peer authenticates
        ok = _connect(ep)
        assert _ask(ok, _hello(TOKEN)).ok
        ok.close()
    finally:
        for sock in [*waiting, late]:
            sock.close()
        ep.stop()


def test_no_usable_token_file_means_no_listener(tmp_path: Path) -> None:
    for content in (None, "", "short\n"):
        path = tmp_path / "tokens"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        ep = LocalEndpoint(
            None, on_records=_noop, tcp=TcpListen(host="127.0.0.1", port=0, token_file=path)
        )
        with pytest.raises(ListenError, match="job token file"):
            ep.start()


def test_unreadable_job_token_file_is_one_line_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "binary").write_bytes(b"\xff" * 20 + b"\n")
    for name, reason in [
        ("missing", "No such file or directory"),
        ("dir", "Is a directory"),
        ("binary", "not UTF-8 text"),
    ]:
        path = tmp_path / name
        with pytest.raises(ListenError) as info:
            JobTokens(path).load()
        assert str(info.value) == f"job token file {path}: cannot read it ({reason})"


def test_job_tokens_compare_every_line_and_reload_on_change(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("a" * 16 + "\n\n" + "b" * 20 + "\n")
    tokens = JobTokens(path)
    assert tokens.check("a" * 16) and tokens.check("b" * 20)
    assert not tokens.check("") and not tokens.check("a" * 15) and not tokens.check("c" * 16)
    path.write_text("c" * 17)
    assert tokens.check("c" * 17) and not tokens.check("a" * 16)
    path.write_text("x")  # a broken rewrite keeps the last good set
    assert tokens.check("c" * 17)


def test_settings() -> None:
    settings = load_settings(
        socket_path="", job_listen="0.0.0.0:9471", job_token_file="/etc/trainguard/job-token"
    )
    tcp = settings.job_tcp()
    assert tcp is not None and (tcp.host, tcp.port) == ("0.0.0.0", 9471)
    assert load_settings(socket_path="").job_tcp() is None
    with pytest.raises(AgentConfigError, match="job_listen needs job_token_file"):
        load_settings(job_listen="0.0.0.0:9471")
    with pytest.raises(AgentConfigError, match="job_listen: must be HOST:PORT"):
        load_settings(job_listen="9471", job_token_file="/t")
    assert parse_listen("[::]:9471") == ("::", 9471)


def test_a_tcp_rank_that_vanishes_is_reported_and_one_that_reconnects_is_not(
    token_file: Path,
) -> None:
    got: list[JobRecords] = []
    ep = LocalEndpoint(
        None,
        on_records=lambda session, records, size: got.append(records),
        tcp=TcpListen(host="127.0.0.1", port=0, token_file=token_file),
        vanish_grace_s=0.2,
    )
    ep.start()
    try:
        gone = _connect(ep)
        assert _ask(gone, _hello(TOKEN)).ok
        gone.close()  # no goodbye, and no peer pid to look at over TCP
        back = _connect(ep)
        assert _ask(back, LocalHello(job="j", rank=1, world_size=2, pid=8, token=TOKEN)
                    .model_dump_json().encode()).ok  # fmt: skip
        back.close()
        again = _connect(ep)  # rank 1 (pid 8) reconnects inside the grace: not vanished
        assert _ask(again, LocalHello(job="j", rank=1, world_size=2, pid=8, token=TOKEN)
                    .model_dump_json().encode()).ok  # fmt: skip
        deadline = time.monotonic() + 3
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.4)  # past rank 1's grace too
        events = [e for records in got for e in records.rank_events]
        assert [(e.rank, e.kind, e.disconnected) for e in events] == [(0, "exited", True)]
        assert "cannot be seen from the agent" in (events[0].error or "")
        again.close()
    finally:
        ep.stop()


def test_the_agent_serves_ranks_over_tcp_only(
    tmp_path: Path, token_file: Path, agents_controller: FakeController
) -> None:
    """The whole agent from its settings: no socket, the TCP endpoint, records reach the
    controller."""
    s = daemon_settings(
        tmp_path, tmp_path, agents_controller.url, report_interval_s=30.0, socket_path="",
        job_listen="127.0.0.1:0", job_token_file=token_file,
    )  # fmt: skip
    agent = Agent(s)
    with Running(agent):
        assert agent.endpoint is not None and agent.endpoint.path is None
        sock = _connect(agent.endpoint)
        try:
            assert _ask(sock, _hello(TOKEN)).ok
            stuck = InflightCollective(
                job="j", rank=0, group="g0", op="all_reduce", seq=41, elapsed_s=12.0
            )
            records = LocalRecords(records=JobRecords(inflight=[stuck]))
            assert _ask(sock, records.model_dump_json().encode()).ok
            agents_controller.wait_for(
                lambda: any(r.job.inflight for r in agents_controller.state.ordered()), 10
            )
        finally:
            sock.close()
