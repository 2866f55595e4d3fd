"""Hostile job-side peers the acceptance probe of the job endpoints found (/tmp/probe-ep):
JSON nested past the parser's depth, peers that trickle a frame a byte at a time, job
records that would make the controller reject the whole report, a rank >= world_size."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from annotated_types import MaxLen
from pydantic import ValidationError

import agents.batch as batch_mod
import agents.local_endpoint as local_endpoint
from agents.batch import MAX_RECORD_BYTES, MAX_TRACE_BYTES, Batch
from agents.local_endpoint import LocalEndpoint, Session
from agents.tcp_endpoint import TcpListen
from tests.agents.agents_testkit import LocalClient
from trainguard import wire
from trainguard.framing import encode_frame, read_frame
from trainguard.wire import (
    FlightRecorderDump,
    JobRecords,
    LocalHello,
    LocalReply,
    NodeIdentity,
    RankEvent,
    Report,
    StepSummary,
)

TOKEN = "job-token-5e8c1a2b9d4f7031"


class Sink:
    def __init__(self) -> None:
        self.items: list[JobRecords] = []

    def __call__(self, session: Session, records: JobRecords, size: int) -> None:
        self.items.append(records)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that escaped any thread (the probe saw a RecursionError kill one)."""
    seen: list[BaseException] = []
    old = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            seen.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield seen
    finally:
        threading.excepthook = old


def _start(short_tmp: Path, sink: Sink, **kw: Any) -> LocalEndpoint:
    tokens = short_tmp / "tokens"
    tokens.write_text(TOKEN + "\n")
    hello_timeout_s = kw.pop("hello_timeout_s", 5.0)
    ep = LocalEndpoint(
        short_tmp / "agent.sock",
        on_records=sink,
        tcp=TcpListen("127.0.0.1", 0, tokens, hello_timeout_s=hello_timeout_s),
        **kw,
    )
    ep.start()
    return ep


@pytest.fixture
def endpoint(short_tmp: Path) -> Iterator[tuple[LocalEndpoint, Sink]]:
    sink = Sink()
    ep = _start(short_tmp, sink)
    try:
        yield ep, sink
    finally:
        ep.stop()


def _tcp(ep: LocalEndpoint) -> socket.socket:
    assert ep.tcp_address is not None
    return socket.create_connection(ep.tcp_address, timeout=5)


def _closed_session(ep: LocalEndpoint, conn_id: int) -> Session:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for s in ep.sessions():
            if s.conn_id == conn_id and s.disconnected_unix_s is not None:
                return s
        time.sleep(0.01)
    raise AssertionError(f"session {conn_id} never closed")


def _step(n: int) -> StepSummary:
    return StepSummary(
        job="j", rank=0, world_size=2, step=n, step_time_s=1.0, compute_time_s=0.8,
        collective_wait_s=0.2,
    )  # fmt: skip


# ---------------------------------------------------------------- F1: deep nesting


def test_deeply_nested_json_gets_one_line_refusal_and_the_connection_stays(
    endpoint: tuple[LocalEndpoint, Sink], thread_errors: list[BaseException]
) -> None:
    ep, sink = endpoint
    assert ep.path is not None
    client = LocalClient(str(ep.path))
    assert client.hello("j", 0).ok
    reply = client.send_raw(b"[" * 100_000 + b"]" * 100_000)
    assert not reply.ok and reply.error == "invalid frame: not JSON: nested too deeply"
    assert client.records(JobRecords(steps=[_step(1)])).ok  # still served
    session = next(s for s in ep.sessions() if s.hello is not None)
    assert session.bad_frames == 1 and session.frames == 3
    assert len(sink.items) == 1
    client.close()
    assert not thread_errors


def test_deeply_nested_first_frame_on_tcp_is_refused_and_closed(
    endpoint: tuple[LocalEndpoint, Sink], thread_errors: list[BaseException]
) -> None:
    ep, _ = endpoint
    sock = _tcp(ep)
    sock.sendall(encode_frame(b"[" * 30_000 + b"]" * 30_000))  # under the 64 KiB pre-auth cap
    reply = LocalReply.model_validate_json(read_frame(sock))
    assert not reply.ok and "nested too deeply" in reply.error
    assert sock.recv(1) == b""  # an unauthenticated peer gets one answer
    session = _closed_session(ep, 1)
    assert session.bad_frames == 1
    assert session.close_reason.startswith("not authenticated: invalid frame")
    sock.close()
    assert not thread_errors


# ---------------------------------------------------------------- F2: slowloris


def _trickle(sock: socket.socket, stop: threading.Event, declared: int) -> None:
    """Announce a ``declared``-byte frame, then send one byte every 0.1 s until refused."""
    try:
        sock.sendall(declared.to_bytes(4, "big"))
        while not stop.wait(0.1):
            sock.sendall(b" ")
    except OSError:
        return


def _trickled_reply(sock: socket.socket) -> tuple[LocalReply, float]:
    stop = threading.Event()
    started = time.monotonic()
    t = threading.Thread(target=_trickle, args=(sock, stop, 1000), daemon=True)
    t.start()
    try:
        sock.settimeout(5.0)  # the old per-recv timeout never fired: this read timed out
        reply = LocalReply.model_validate_json(read_frame(sock))
        return reply, time.monotonic() - started
    finally:
        stop.set()
        t.join(5)


def test_a_trickled_hello_is_cut_at_the_hello_deadline(
    short_tmp: Path, thread_errors: list[BaseException]
) -> None:
    ep = _start(short_tmp, Sink(), hello_timeout_s=0.5)
    try:
        sock = _tcp(ep)
        reply, took = _trickled_reply(sock)
        assert not reply.ok and reply.error == "closing: no hello for 0.5 s"
        assert took < 3.0
        sock.close()
        assert _closed_session(ep, 1).close_reason == "no hello for 0.5 s"
    finally:
        ep.stop()
    assert not thread_errors


def test_a_trickled_frame_is_cut_at_the_idle_timeout(
    short_tmp: Path, thread_errors: list[BaseException]
) -> None:
    ep = _start(short_tmp, Sink(), idle_timeout_s=0.5)
    try:
        assert ep.path is not None
        client = LocalClient(str(ep.path))
        assert client.hello("j", 0).ok
        reply, took = _trickled_reply(client.sock)
        assert not reply.ok and reply.error == "closing: no frame for 0.5 s"
        assert took < 3.0
        client.close()
    finally:
        ep.stop()
    assert not thread_errors


def test_read_frame_deadline_covers_the_whole_frame() -> None:
    a, b = socket.socketpair()
    stop = threading.Event()
    t = threading.Thread(target=_trickle, args=(b, stop, 1000), daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            read_frame(a, deadline=time.monotonic() + 0.4)
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        a.close()
        b.close()
        t.join(5)


# ---------------------------------------------------------------- F3: report limits


def _wire_max(name: str) -> int:
    meta = JobRecords.model_fields[name].metadata
    return min(m.max_length for m in meta if isinstance(m, MaxLen))


def test_batch_caps_come_from_the_wire_limits() -> None:
    for name in JobRecords.model_fields:
        assert 0 < batch_mod._RECORD_CAPS[name] <= _wire_max(name) // 2, name
    assert batch_mod._RECORD_CAPS["traces"] == 512  # the wire's 1,024 halved, not 2,048
    assert MAX_TRACE_BYTES < MAX_RECORD_BYTES < wire.MAX_REPORT_BYTES


def _dump(rank: int, entries: int = 0, pad: int = 0) -> FlightRecorderDump:
    return FlightRecorderDump(
        job="j", rank=rank, enabled=True, entries=[{"frames": "x" * pad}] * entries
    )


def _add(batch: Batch, records: JobRecords) -> None:
    batch.add_records(records, len(records.model_dump_json(exclude_defaults=True)))


def test_more_traces_than_the_wire_takes_are_dropped_and_the_records_validate(
    tmp_path: Path,
) -> None:
    batch = Batch(tmp_path, next_seq=0)
    for frame in range(11):
        _add(batch, JobRecords(traces=[_dump(frame * 100 + i) for i in range(100)]))
    records = batch.peek().records
    JobRecords.model_validate(records.model_dump())  # raised for 1,100 traces before
    assert len(records.traces) == 512 and batch.dropped_records_total == 1100 - 512
    batch.close()


def test_job_records_stop_at_the_byte_budget_and_samples_still_fit(tmp_path: Path) -> None:
    batch = Batch(tmp_path, next_seq=0)
    # Ten dumps of ~0.9 MiB each, each under MAX_TRACE_BYTES, then a rank's exit event.
    for rank in range(10):
        _add(batch, JobRecords(traces=[_dump(rank, entries=90, pad=10_000)]))
    exited = RankEvent(job="j", rank=3, kind="exited", pid=9, time_unix_s=1.0, world_size=16)
    _add(batch, JobRecords(rank_events=[exited], steps=[_step(1)]))
    records = batch.peek().records
    assert batch_mod._BUDGET_ORDER[0] == "rank_events"
    size = len(records.model_dump_json(exclude_none=True))
    assert size <= MAX_RECORD_BYTES
    assert 0 < len(records.traces) < 10
    assert batch.dropped_records_total == 10 - len(records.traces)
    # The small records of a frame past the budget are kept when they fit.
    assert records.rank_events == [exited] and len(records.steps) == 1
    batch.close()
    # And the journal replays within the same budget.
    replayed = Batch(tmp_path, next_seq=0)
    replayed_size = len(replayed.peek().records.model_dump_json(exclude_none=True))
    assert replayed_size <= MAX_RECORD_BYTES
    replayed.close()


def test_a_batch_past_its_budget_still_makes_a_report_under_the_body_limit(
    tmp_path: Path,
) -> None:
    batch = Batch(tmp_path, next_seq=0)
    big = JobRecords(steps=[_step(n) for n in range(10_000)])
    for _ in range(6):
        _add(batch, big)
    for rank in range(8):
        _add(batch, JobRecords(traces=[_dump(rank, entries=90, pad=10_000)]))
    c = batch.peek()
    report = Report(
        node=NodeIdentity(name="n"), agent_instance="a", seq=0, sent_unix_s=1.0, job=c.records
    )
    body = report.model_dump_json(exclude_none=True).encode()  # as agents.spool does
    assert len(body) < wire.MAX_REPORT_BYTES
    Report.model_validate_json(body)
    batch.close()


def test_endpoint_refuses_a_dump_larger_than_its_share_of_a_report(
    endpoint: tuple[LocalEndpoint, Sink],
) -> None:
    ep, sink = endpoint
    assert ep.path is not None
    client = LocalClient(str(ep.path))
    assert client.hello("j", 0).ok
    huge = _dump(0, entries=4096, pad=300)
    assert len(huge.model_dump_json()) > MAX_TRACE_BYTES
    reply = client.records(JobRecords(traces=[huge]))
    assert not reply.ok
    assert reply.error.startswith("Flight Recorder dump of rank 0 is ")
    assert f"at most {MAX_TRACE_BYTES} per dump" in reply.error
    assert client.records(JobRecords(traces=[_dump(0, entries=10)])).ok  # connection kept
    assert [len(r.traces) for r in sink.items] == [1]
    client.close()


# ---------------------------------------------------------------- F4: rank >= world_size


def test_hello_with_rank_not_below_world_size_is_refused(
    endpoint: tuple[LocalEndpoint, Sink],
) -> None:
    with pytest.raises(ValidationError, match="rank 5 must be less than world_size 2"):
        LocalHello(job="j", rank=5, world_size=2, pid=1)
    ep, _ = endpoint
    assert ep.path is not None
    client = LocalClient(str(ep.path))
    reply = client.send_json({"type": "hello", "job": "j", "rank": 5, "world_size": 2, "pid": 1})
    assert not reply.ok
    assert reply.error == (
        "invalid frame: hello: Value error, rank 5 must be less than world_size 2"
    )
    assert client.hello("j", 1).ok
    client.close()


def test_a_failing_vanish_report_is_logged_not_raised(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sink = Sink()
    ep = LocalEndpoint(short_tmp / "agent.sock", on_records=sink)
    monkeypatch.setattr(local_endpoint, "process_state", lambda pid: "gone")
    # A hello no validator checked (as before LocalHello refused it): the exit event fails.
    hello = LocalHello.model_construct(
        type="hello", job="j", rank=5, world_size=2, pid=1, local_rank=None, gpu_index=None,
        pod="", namespace="", token="",
    )  # fmt: skip
    session = Session(1, time.time(), hello=hello, disconnected_unix_s=time.time())
    with caplog.at_level(logging.ERROR, logger="agents.local_endpoint"):
        ep._check_vanished(session)  # raised ValidationError on its timer thread before
    assert not session.reported_vanished and not sink.items
    assert any(
        "could not report vanished rank 5 of job j" in r.getMessage() for r in caplog.records
    )
    assert json.dumps([r.getMessage() for r in caplog.records]).count("\\n") == 0


def test_empty_frames_take_none_of_the_byte_budget(tmp_path: Path) -> None:
    batch = Batch(tmp_path, next_seq=0)
    for _ in range(50_000):  # a 300 s report interval of ranks shipping empty frames
        batch.add_records(JobRecords(), 20)
    _add(batch, JobRecords(steps=[_step(n) for n in range(10_000)]))
    assert len(batch.peek().records.steps) == 10_000 and batch.dropped_records_total == 0
    batch.close()
