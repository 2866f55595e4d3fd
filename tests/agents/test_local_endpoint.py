"""The agent's Unix socket: framing round trip, validation, limits, socket file hygiene."""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.errors import ListenError
from agents.local_endpoint import LocalEndpoint, Session, process_state
from tests.agents.agents_testkit import LocalClient
from trainguard.framing import MAX_FRAME_BYTES, FrameError, read_frame
from trainguard.wire import JobCheckpoint, JobRecords, LocalReply, RankEvent, StepSummary


class Sink:
    def __init__(self) -> None:
        self.items: list[tuple[str, JobRecords, int]] = []
        self.lock = threading.Lock()

    def __call__(self, session: Session, records: JobRecords, size: int) -> None:
        assert session.hello is not None
        with self.lock:
            self.items.append((session.hello.job, records, size))


@pytest.fixture
def endpoint(short_tmp: Path) -> Iterator[tuple[LocalEndpoint, Sink]]:
    sink = Sink()
    ep = LocalEndpoint(short_tmp / "agent.sock", on_records=sink)
    ep.start()
    try:
        yield ep, sink
    finally:
        ep.stop()


def step(job: str, n: int) -> StepSummary:
    return StepSummary(
        job=job, rank=0, world_size=2, step=n, step_time_s=1.0, compute_time_s=0.8,
        collective_wait_s=0.2,
    )  # fmt: skip


def test_hello_records_round_trip_and_commands_flow_back(
    endpoint: tuple[LocalEndpoint, Sink],
) -> None:
    ep, sink = endpoint
    client = LocalClient(str(ep.path))
    other = LocalClient(str(ep.path))
    try:
        assert client.hello("train-a", rank=0).ok
        assert other.hello("train-b", rank=0).ok
        reply = client.records(JobRecords(steps=[step("train-a", 1), step("train-a", 2)]))
        assert reply.ok and reply.commands == []
        assert sink.items[0][0] == "train-a" and len(sink.items[0][1].steps) == 2
        assert sink.items[0][2] > 100  # frame size is passed on for batching
        assert ep.enqueue(JobCheckpoint(id="c1", job="train-a", at_step=10)) == 1
        assert ep.enqueue(JobCheckpoint(id="c2", job="nobody")) == 0
        reply = client.records(JobRecords())
        assert [c.id for c in reply.commands] == ["c1"]
        assert client.records(JobRecords()).commands == []  # handed out once
        assert other.records(JobRecords()).commands == []  # other jobs see nothing
    finally:
        client.close()
        other.close()


def test_invalid_frames_get_an_error_reply_and_the_connection_stays(
    endpoint: tuple[LocalEndpoint, Sink],
) -> None:
    ep, sink = endpoint
    client = LocalClient(str(ep.path))
    try:
        reply = client.records(JobRecords())
        assert not reply.ok and "hello" in reply.error
        reply = client.send_raw(b"{not json")
        assert not reply.ok and reply.error.startswith("invalid frame: not JSON")
        reply = client.send_json(
            {"type": "hello", "job": "Bad Job", "rank": 0, "world_size": 1, "pid": 1}
        )
        assert not reply.ok and "job" in reply.error and "\n" not in reply.error
        reply = client.send_json({"type": "launch_missiles"})
        assert not reply.ok and "type" in reply.error
        assert client.hello("train-a", rank=1).ok
        assert not client.hello("train-a", rank=1).ok  # a second hello
        foreign = client.records(JobRecords(steps=[step("train-z", 1)]))
        assert not foreign.ok and "train-z" in foreign.error
        assert client.records(JobRecords(steps=[step("train-a", 1)])).ok  # still connected
        assert len(sink.items) == 1
    finally:
        client.close()
    sessions = ep.sessions()
    assert sessions and sessions[0].bad_frames == 6


def test_oversize_frame_is_refused_before_reading_and_drops_the_connection(
    endpoint: tuple[LocalEndpoint, Sink],
) -> None:
    ep, _ = endpoint
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(ep.path))
    sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    reply = LocalReply.model_validate_json(read_frame(sock))
    assert not reply.ok and "framing error" in reply.error
    with pytest.raises(FrameError):
        read_frame(sock)  # the agent closed the connection
    sock.close()
    # A truncated frame (client dies mid-frame) is just a closed connection.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(ep.path))
    sock.sendall(struct.pack(">I", 100) + b"{")
    sock.close()
    time.sleep(0.1)
    assert LocalClient(str(ep.path)).hello("x", 0).ok  # the server is unharmed


def test_disconnect_of_a_live_process_is_recorded_but_no_exit_event_is_invented(
    short_tmp: Path,
) -> None:
    sink = Sink()
    ep = LocalEndpoint(short_tmp / "agent.sock", on_records=sink, vanish_grace_s=0.05)
    ep.start()
    client = LocalClient(str(ep.path))
    client.hello("train-a", rank=3, world_size=4, pid=4242)
    client.records(
        JobRecords(rank_events=[RankEvent(job="train-a", rank=3, kind="started", time_unix_s=1.0)])
    )
    client.close()
    deadline = time.monotonic() + 5
    while not any(s.disconnected_unix_s for s in ep.sessions()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closed = next(s for s in ep.sessions() if s.disconnected_unix_s)
    assert closed.hello is not None and closed.hello.pid == 4242 and closed.frames == 2
    assert closed.peer_pid == os.getpid() and closed.peer_uid == os.getuid()  # from the kernel
    time.sleep(0.5)  # well past the grace: the process (this one) is alive, so nothing
    ep.stop()
    assert [e.kind for _, r, _ in sink.items for e in r.rank_events] == ["started"]
    assert not closed.reported_vanished


CHILD = """
import os, socket, sys, time
from trainguard.framing import encode_frame, read_frame
from trainguard.wire import JobRecords, LocalHello, LocalRecords, RankEvent
path, mode = sys.argv[1], sys.argv[2]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
def send(message):
    sock.sendall(encode_frame(message.model_dump_json().encode()))
    read_frame(sock)
send(LocalHello(job="train-a", rank=1, world_size=2, pid=os.getpid(), local_rank=1, gpu_index=1))
events = []
if mode == "exit":
    events = [RankEvent(job="train-a", rank=1, kind="exited", exit_code=0, time_unix_s=time.time())]
send(LocalRecords(records=JobRecords(rank_events=events), closing=mode == "closing"))
print("ready", flush=True)
if mode == "kill":
    time.sleep(60)
"""


def _rank_process(path: Path, mode: str) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _exits(sink: Sink) -> list[RankEvent]:
    with sink.lock:
        return [e for _, r, _ in sink.items for e in r.rank_events if e.kind == "exited"]


def test_a_rank_killed_from_outside_is_reported_as_exited_with_unknown_cause(
    short_tmp: Path,
) -> None:
    sink = Sink()
    ep = LocalEndpoint(short_tmp / "agent.sock", on_records=sink, vanish_grace_s=0.2)
    ep.start()
    proc = _rank_process(ep.path, "kill")
    try:
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)  # not reaped yet: a zombie still counts as gone
        deadline = time.monotonic() + 10
        while not _exits(sink):
            assert time.monotonic() < deadline, "no exit reported for the killed rank"
            time.sleep(0.02)
        (event,) = _exits(sink)
    finally:
        proc.wait(timeout=10)
        ep.stop()
    assert (event.job, event.rank, event.pid, event.world_size) == ("train-a", 1, proc.pid, 2)
    assert (event.local_rank, event.gpu_index) == (1, 1)
    assert event.disconnected and event.exit_code is None and event.signal is None
    assert not event.collective_failed and "vanished" in event.error
    assert killed_at - 1 <= event.time_unix_s <= time.time()  # when its connection closed
    (session,) = [s for s in ep.sessions() if s.hello is not None]
    assert session.reported_vanished and session.peer_pid == proc.pid


@pytest.mark.parametrize("mode", ["exit", "closing"])
def test_a_rank_that_said_goodbye_is_not_reported_when_it_is_gone(
    short_tmp: Path, mode: str
) -> None:
    sink = Sink()
    ep = LocalEndpoint(short_tmp / "agent.sock", on_records=sink, vanish_grace_s=0.05)
    ep.start()
    proc = _rank_process(ep.path, mode)
    assert proc.wait(timeout=10) == 0
    time.sleep(0.5)
    ep.stop()
    assert [e.disconnected for e in _exits(sink)] == ([False] if mode == "exit" else [])
    assert all(s.said_goodbye for s in ep.sessions() if s.hello is not None)


def test_process_state_reads_proc() -> None:
    assert process_state(os.getpid()) == "alive"
    assert process_state(None) == process_state(0) == "unknown"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_state(child.pid) == "gone"


def test_socket_file_mode_stale_replacement_live_refusal_and_cleanup(short_tmp: Path) -> None:
    path = short_tmp / "a.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # a crashed agent's leftover: the file exists, nobody listens
    first = LocalEndpoint(path, on_records=Sink())
    first.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        second = LocalEndpoint(path, on_records=Sink())
        with pytest.raises(ListenError, match="another agent is listening"):
            second.start()
    finally:
        first.stop()
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(ListenError, match="is not a socket"):
        LocalEndpoint(path, on_records=Sink()).start()
