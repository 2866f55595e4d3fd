"""The agent's Unix socket for job-side code (framing: :mod:`trainguard.framing`).

A client says ``hello`` (job, rank, pid) once, then sends ``records`` batches; every frame
gets exactly one ``reply`` carrying the job commands queued for that client. A frame that
is valid framing but not a valid message gets ``ok=false`` with a one-line error and the
connection stays; broken framing (oversized or truncated) ends the connection, because
the byte stream can no longer be trusted.

The socket is created ``0o660`` (owner and group: the training pods' group, not the world),
a stale socket left by a crashed agent is replaced, a live one is refused, and the file is
removed on shutdown.

The same endpoint can also accept ranks over TCP (:mod:`agents.tcp_endpoint`: a token in
the hello, for training pods that may not mount a hostPath); both kinds of connection share
the sessions, the command queues and the bounds below. Every connection is closed after
``idle_timeout_s`` without a frame (a live client ships one every ~0.15 s).

A rank that exits cleanly says so before its connection closes (an ``exited`` rank event,
or a last frame with ``closing=True`` when it stops instrumenting). A rank killed from
outside (SIGKILL, the OOM killer) can say nothing: its connection just closes, and its
peers then fail inside their next collective and report *that*, which would blame them.
So a client that disconnects without either is checked ``VANISH_GRACE_S`` later: if its
process is gone (no ``/proc/<pid>``, or a zombie) or cannot be seen, and it did not
reconnect meanwhile, the endpoint reports an ``exited`` event for it on its behalf, with
``disconnected=True`` and no exit code or signal (they are unknown), stamped with the
disconnect time on this node's clock. A live process that merely dropped its connection
(a timeout on a wedged agent) is not reported; it reconnects.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from agents.batch import MAX_TRACE_BYTES, report_size
from agents.errors import ListenError
from agents.sampler import MigGpuInfo
from agents.tcp_endpoint import (
    HELLO_MAX_BYTES,
    MAX_UNAUTHENTICATED,
    JobTokens,
    TcpListen,
    bind_tcp,
)
from trainguard.framing import MAX_FRAME_BYTES, FrameError, encode_frame, read_frame
from trainguard.wire import (
    MAX_REPORT_BYTES,
    Command,
    GpuInfo,
    JobCommand,
    JobRecords,
    LocalHello,
    LocalMessage,
    LocalRecords,
    LocalReply,
    RankEvent,
)

log = logging.getLogger(__name__)

_MESSAGE = TypeAdapter(LocalMessage)
SOCKET_MODE = 0o660
#: Concurrent clients; a node runs one per rank (8-ish) plus launchers.
MAX_CLIENTS = 256
#: Commands queued per client before the oldest are dropped (a client that never asks).
MAX_QUEUED_COMMANDS = 64
#: Closed sessions remembered for inspection.
CLOSED_SESSIONS_KEPT = 256
#: Seconds between a client's unannounced disconnect and the check whether its process is
#: gone: lets a dying process become a zombie (its sockets close before it does) and a
#: merely disconnected client reconnect, while the peers' collateral exits still wait for
#: this report (the controller waits 10 s for it).
VANISH_GRACE_S = 1.0
#: Seconds without a frame after which a connection is closed: clients ship an (often empty)
#: frame every ~0.15 s, so a minute of silence is a wedged or abandoned peer holding a seat.
IDLE_TIMEOUT_S = 60.0

RecordsSink = Callable[["Session", JobRecords, int], None]
#: This node's GPUs as the sampler knows them (NVML index and UUID), read at each hello.
GpuInventory = Callable[[], Iterable[GpuInfo]]
#: Jobs remembered for the once-per-job GPU placement log lines before the memory restarts.
_PLACEMENT_LOG_JOBS = 1024


@dataclass(slots=True)
class Session:
    """One client connection, kept after it closes as a record of who talked to us."""

    conn_id: int
    connected_unix_s: float
    #: ``unix`` or ``tcp`` (then :attr:`peer_addr` says who, and there is no peer pid).
    transport: str = "unix"
    peer_addr: str = ""
    #: Kernel-reported peer (SO_PEERCRED); the hello's pid may differ across PID namespaces.
    peer_pid: int | None = None
    peer_uid: int | None = None
    hello: LocalHello | None = None
    frames: int = 0
    bad_frames: int = 0
    disconnected_unix_s: float | None = None
    close_reason: str = ""
    #: The client sent an ``exited`` rank event or a ``closing`` frame: a clean goodbye.
    said_goodbye: bool = False
    #: The endpoint reported this client's rank as vanished (an exit with unknown cause).
    reported_vanished: bool = False
    #: The hello's GPU UUID named another of this node's GPUs than the rank's own number
    #: did: its records are moved to that index (none are rewritten when they agree).
    gpu_from_uuid: bool = False
    queued: deque[Command] = field(default_factory=lambda: deque(maxlen=MAX_QUEUED_COMMANDS))


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "frame"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {err['msg']}{more}"


def _exc_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return _one_line(exc)
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(
            f"socket_path {path} exists and is not a socket; remove it or pick another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.info("replacing stale socket %s left by a previous agent", path)
            path.unlink(missing_ok=True)
            return
        raise ListenError(f"socket_path {path}: cannot probe it ({exc})") from None
    finally:
        probe.close()
    raise ListenError(f"another agent is listening on {path}; stop it or set another socket_path")


class LocalEndpoint:
    """Threaded server: one accept thread, one thread per client."""

    def __init__(
        self,
        path: Path | None,
        *,
        on_records: RecordsSink,
        vanish_grace_s: float = VANISH_GRACE_S,
        tcp: TcpListen | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        gpu_inventory: GpuInventory | None = None,
    ) -> None:
        if path is None and tcp is None:
            raise ListenError("the local endpoint needs a socket path, a TCP listener, or both")
        self.path = path
        self.tcp = tcp
        self._tokens = JobTokens(tcp.token_file) if tcp is not None else None
        self._on_records = on_records
        self.vanish_grace_s = vanish_grace_s
        self.idle_timeout_s = idle_timeout_s
        self._gpus = GpuPlacer(gpu_inventory)
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._conns: dict[int, socket.socket] = {}
        self._closed: deque[Session] = deque(maxlen=CLOSED_SESSIONS_KEPT)
        self._server: socket.socket | None = None
        self._tcp_server: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._tcp_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_id = 0
        self._inode: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        """The bound TCP (host, port) once started (the port is real when 0 was asked)."""
        if self._tcp_server is None:
            return None
        host, port = self._tcp_server.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        if self.tcp is not None:
            assert self._tokens is not None
            self._tokens.load()  # no token file, no listener: refuse to start unauthenticated
            self._tcp_server = bind_tcp(self.tcp)
        try:
            if self.path is not None:
                self._start_unix(self.path)
        except BaseException:
            if self._tcp_server is not None:
                self._tcp_server.close()
            raise
        if self._tcp_server is not None:
            self._tcp_thread = threading.Thread(
                target=self._accept_loop,
                args=(self._tcp_server, "tcp"),
                name="local-accept-tcp",
                daemon=True,
            )
            self._tcp_thread.start()
            host, port = self.tcp_address or ("?", 0)
            log.info("job endpoint listening on %s:%d (TCP, token required)", host, port)

    def _start_unix(self, path: Path) -> None:
        self.path = path
        _remove_stale_socket(self.path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # no window where the socket is world-accessible
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            server.bind(str(self.path))
            os.chmod(self.path, SOCKET_MODE)
        except OSError as exc:
            server.close()
            raise ListenError(f"socket_path {self.path}: cannot create it ({exc})") from None
        finally:
            os.umask(old_umask)
        self._inode = self.path.stat().st_ino
        server.listen(64)
        server.settimeout(0.2)
        self._server = server
        self._thread = threading.Thread(
            target=self._accept_loop, args=(server, "unix"), name="local-accept", daemon=True
        )
        self._thread.start()
        log.info("local endpoint listening on %s", self.path)

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._tcp_thread):
            if thread is not None:
                thread.join(timeout=5)
        for server in (self._server, self._tcp_server):
            if server is not None:
                server.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            if self.path is not None and self._inode and self.path.stat().st_ino == self._inode:
                self.path.unlink()  # only our own socket, not a successor's

    # ------------------------------------------------------------------ sessions

    def sessions(self) -> list[Session]:
        """Live sessions first, then recently closed ones."""
        with self._lock:
            return list(self._sessions.values()) + list(self._closed)

    def enqueue(self, cmd: JobCommand) -> int:
        """Queue a job command for every connected client of its job; returns how many."""
        with self._lock:
            targets = [s for s in self._sessions.values() if s.hello and s.hello.job == cmd.job]
            for session in targets:
                session.queued.append(cmd)
        return len(targets)

    # ------------------------------------------------------------------ serving

    def _accept_loop(self, server: socket.socket, transport: str) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("local endpoint accept failed: %s", exc)
                time.sleep(0.1)
                continue
            with self._lock:
                full = ""
                if len(self._sessions) >= MAX_CLIENTS:
                    full = f"agent has {MAX_CLIENTS} clients"
                elif transport == "tcp" and self._unauthenticated() >= MAX_UNAUTHENTICATED:
                    full = f"agent has {MAX_UNAUTHENTICATED} connections waiting for a hello"
                else:
                    self._next_id += 1
                    if transport == "tcp":
                        session = Session(self._next_id, time.time(), "tcp", f"{addr[0]}:{addr[1]}")
                    else:
                        pid, uid = _peer_credentials(conn)
                        session = Session(self._next_id, time.time(), peer_pid=pid, peer_uid=uid)
                    self._sessions[session.conn_id] = session
                    self._conns[session.conn_id] = conn
            if full:
                self._send(conn, LocalReply(ok=False, error=full))
                conn.close()
                continue
            if transport == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve,
                args=(conn, session),
                name=f"local-{session.conn_id}",
                daemon=True,
            ).start()

    def _unauthenticated(self) -> int:
        """TCP connections still without a good hello (call with the lock held)."""
        return sum(1 for s in self._sessions.values() if s.transport == "tcp" and not s.hello)

    def _send(self, conn: socket.socket, reply: LocalReply) -> bool:
        try:
            conn.sendall(encode_frame(reply.model_dump_json().encode()))
            return True
        except (OSError, FrameError):
            return False

    def _serve(self, conn: socket.socket, session: Session) -> None:
        reason = "closed by client"
        tcp = session.transport == "tcp"
        hello_s = self.tcp.hello_timeout_s if self.tcp is not None else self.idle_timeout_s
        hello_deadline = time.monotonic() + hello_s  # the whole hello, counted from accept
        try:
            while not self._stop.is_set():
                waiting = tcp and session.hello is None
                # An absolute deadline per frame: a complete frame within the idle timeout
                # (the hello within hello_s of accept), however slowly its bytes trickle in.
                limit_s = hello_s if waiting else self.idle_timeout_s
                deadline = hello_deadline if waiting else time.monotonic() + limit_s
                try:
                    payload = read_frame(
                        conn, HELLO_MAX_BYTES if waiting else MAX_FRAME_BYTES, deadline=deadline
                    )
                except TimeoutError:
                    what = "hello" if waiting else "frame"  # complete, by the deadline
                    reason = f"no {what} for {limit_s:g} s"
                    conn.settimeout(1.0)  # the goodbye must not wait on a peer that never reads
                    self._send(conn, LocalReply(ok=False, error=f"closing: {reason}"))
                    log.info("local client %d: %s; closing it", session.conn_id, reason)
                    return
                except FrameError as exc:
                    if "closed" not in str(exc):
                        session.bad_frames += 1
                        self._send(conn, LocalReply(ok=False, error=f"framing error: {exc}"))
                        log.warning("local client %d: %s; dropping it", session.conn_id, exc)
                    reason = str(exc)
                    return
                except OSError as exc:
                    reason = f"socket error: {exc}"
                    return
                session.frames += 1
                try:
                    reply = self._reply(session, payload)
                except Exception as exc:  # a bug or a failing sink: one line, keep serving
                    session.bad_frames += 1
                    log.error("local client %d: frame failed: %s", session.conn_id, _exc_line(exc))
                    reply = LocalReply(ok=False, error=f"agent error: {_exc_line(exc)}"[:500])
                conn.settimeout(self.idle_timeout_s)  # the reply, not what the read left over
                if not self._send(conn, reply):
                    reason = "client went away before the reply"
                    return
                if tcp and session.hello is None:
                    reason = f"not authenticated: {reply.error}"
                    return  # a TCP peer gets one answer, not a conversation, without a token
        finally:
            conn.close()
            session.disconnected_unix_s = time.time()
            session.close_reason = "agent stopping" if self._stop.is_set() else reason
            with self._lock:
                self._sessions.pop(session.conn_id, None)
                self._conns.pop(session.conn_id, None)
                self._closed.append(session)
            if session.hello is not None and not session.said_goodbye and not self._stop.is_set():
                timer = threading.Timer(self.vanish_grace_s, self._check_vanished, (session,))
                timer.daemon = True
                timer.start()

    def _check_vanished(self, session: Session) -> None:
        """Report the rank of a client that left without a goodbye, if its process is gone."""
        hello = session.hello
        if hello is None or self._stop.is_set():
            return
        with self._lock:
            back = any(
                s.hello is not None
                and (s.hello.job, s.hello.rank, s.hello.pid) == (hello.job, hello.rank, hello.pid)
                for s in self._sessions.values()
            )
        if back:
            return  # the same process reconnected: it only lost its connection
        state = process_state(session.peer_pid)
        if state == "alive":
            log.info(
                "local client %d (job %s rank %d) disconnected without an exit record; its "
                "process %s is alive",
                session.conn_id,
                hello.job,
                hello.rank,
                session.peer_pid,
            )
            return
        seen = "is gone" if state == "gone" else "cannot be seen from the agent"
        log.warning(
            "job %s rank %d (pid %d) vanished: its connection closed without an exit record "
            "and its process %s; reporting it as exited (cause unknown)",
            hello.job,
            hello.rank,
            hello.pid,
            seen,
        )
        try:  # a timer thread: log, never raise (nor claim a report that was not made)
            self._report_vanished(session, hello, seen)
        except Exception as exc:
            log.error(
                "could not report vanished rank %d of job %s: %s",
                hello.rank,
                hello.job,
                _exc_line(exc),
            )

    def _report_vanished(self, session: Session, hello: LocalHello, seen: str) -> None:
        event = RankEvent(
            job=hello.job,
            rank=hello.rank,
            kind="exited",
            pid=hello.pid,
            time_unix_s=session.disconnected_unix_s or time.time(),
            local_rank=hello.local_rank,
            gpu_index=hello.gpu_index,
            world_size=hello.world_size,
            error=(
                f"rank process vanished without an exit record (process {seen}): "
                "killed from outside? (SIGKILL, the OOM killer)"
            ),
            disconnected=True,
        )
        self._on_records(session, JobRecords(rank_events=[event]), 0)
        session.reported_vanished = True

    def _reply(self, session: Session, payload: bytes) -> LocalReply:
        try:
            message = _MESSAGE.validate_python(json.loads(payload))
        except (ValueError, ValidationError, RecursionError) as exc:
            # RecursionError: JSON nested past the parser's depth ("[" * 100000), which is
            # a RuntimeError, not a ValueError; once it killed the connection's thread.
            session.bad_frames += 1
            if isinstance(exc, ValidationError):
                error = _one_line(exc)
            elif isinstance(exc, RecursionError):
                error = "not JSON: nested too deeply"
            else:
                error = f"not JSON: {exc}"
            return LocalReply(ok=False, error=f"invalid frame: {error}"[:500])
        if isinstance(message, LocalHello):
            if session.hello is not None:
                session.bad_frames += 1
                return LocalReply(ok=False, error="hello already received on this connection")
            if session.transport == "tcp":
                assert self._tokens is not None
                if not self._tokens.check(message.token):
                    session.bad_frames += 1
                    log.warning(
                        "job endpoint: refused %s (job %s rank %d): %s job token",
                        session.peer_addr,
                        message.job,
                        message.rank,
                        "wrong" if message.token else "no",
                    )
                    return LocalReply(
                        ok=False,
                        error=(
                            "authentication failed: the hello's job token is "
                            f"{'wrong' if message.token else 'missing'}; mount the job-token "
                            "Secret and set TRAINGUARD_AGENT_TOKEN_FILE (docs/kubernetes.md)"
                        ),
                    )
            hello, session.gpu_from_uuid = self._gpus.place(message)
            session.hello = hello.model_copy(update={"token": ""})  # never kept
            log.info(
                "local client %d: job %s rank %d pid %d",
                session.conn_id,
                message.job,
                message.rank,
                message.pid,
            )
            return LocalReply(ok=True)
        assert isinstance(message, LocalRecords)
        if session.hello is None:
            session.bad_frames += 1
            return LocalReply(ok=False, error="send a hello frame before records")
        foreign = _foreign_job(message.records, session.hello.job)
        if foreign is not None:
            session.bad_frames += 1
            return LocalReply(
                ok=False,
                error=f"records for job {foreign!r} on a connection of job {session.hello.job!r}",
            )
        oversized = _oversized_trace(message.records)
        if oversized is not None:
            session.bad_frames += 1
            return LocalReply(ok=False, error=oversized)
        if message.closing or any(e.kind == "exited" for e in message.records.rank_events):
            session.said_goodbye = True
        records = message.records
        if session.gpu_from_uuid and session.hello.gpu_index is not None:
            records = on_gpu(records, session.hello.gpu_index)
        self._on_records(session, records, len(payload))
        with self._lock:
            commands = list(session.queued)
            session.queued.clear()
        return LocalReply(ok=True, commands=commands)


class GpuPlacer:
    """Ties a rank to this node's NVML index through its GPU's UUID.

    A rank's own number is CUDA's, relative to the pod's ``CUDA_VISIBLE_DEVICES`` (the device
    plugin's subset), or a launcher's guess; the agent's samples are keyed by the node's NVML
    index. The UUID is the same for both, so when the hello names one of this node's GPUs its
    index wins. A rank on a MIG slice names the slice (``MIG-...``), which the inventory lists
    under its parent GPU (:class:`agents.sampler.MigGpuInfo`): the parent's index wins, as
    its power, clocks and XIDs are the slice's. A UUID found nowhere (another node's GPU, a
    slice of a GPU whose instances could not be listed) leaves the rank's number, with the
    reason. Each case is logged once per job.
    """

    def __init__(self, inventory: GpuInventory | None) -> None:
        self._inventory = inventory
        self._said: set[tuple[str, str]] = set()

    def place(self, hello: LocalHello) -> tuple[LocalHello, bool]:
        """``hello`` with the index of the GPU its UUID names, and whether that index differs
        from the rank's own (its records are then moved to it, :func:`on_gpu`)."""
        wanted = canonical_uuid(hello.gpu_uuid)
        if not wanted or self._inventory is None:
            return hello, False
        gpus = self._read()
        index = gpus.whole.get(wanted)
        if index is None:
            # By the bare hex: a slice's UUID reaches us as ``GPU-<hex>`` when its pod's
            # CUDA_VISIBLE_DEVICES did not name it (CUDA itself cannot tell a slice).
            index = gpus.mig.get(_bare_uuid(wanted))
            if index is None:
                self._unknown(hello, gpus)
                return hello, False
            self._once(
                hello,
                "mig",
                "MIG instance %s is on GPU %d (says GPU %s)",
                hello.gpu_uuid,
                index,
                hello.gpu_index,
            )
        elif index != hello.gpu_index:
            self._once(
                hello,
                "moved",
                "says GPU %s, but its UUID %s is this node's GPU %d (CUDA numbers the "
                "pod's GPUs, NVML the node's): using %d",
                hello.gpu_index,
                hello.gpu_uuid,
                index,
                index,
            )
        if index == hello.gpu_index:
            return hello, False  # its records already carry the node's number: untouched
        return hello.model_copy(update={"gpu_index": index}), True

    def _read(self) -> _PlacementInventory:
        assert self._inventory is not None
        out = _PlacementInventory()
        try:
            for gpu in self._inventory():
                out.whole[canonical_uuid(gpu.uuid)] = gpu.index
                if isinstance(gpu, MigGpuInfo):
                    out.mig_gpus.append(gpu.index)
                    out.mig.update(
                        (_bare_uuid(canonical_uuid(u)), gpu.index) for u in gpu.mig_uuids
                    )
                    if gpu.mig_error:
                        out.refused[gpu.index] = gpu.mig_error
        except Exception as exc:  # a hello must never fail on the inventory: keep the number
            log.warning("GPU inventory unreadable for rank placement: %s", _exc_line(exc))
            return _PlacementInventory()
        return out

    def _unknown(self, hello: LocalHello, gpus: _PlacementInventory) -> None:
        """Say once per job why the rank keeps its own number (a WARNING: it may be wrong)."""
        refused = "; ".join(f"GPU {i}: {why}" for i, why in sorted(gpus.refused.items()))
        if not hello.gpu_uuid.strip().lower().startswith("mig-"):
            why = "not on this node"
            if refused:
                why += f" (nor a listed MIG instance; not listed: {refused})"
        elif refused:
            why = f"a MIG instance of a GPU whose instances could not be listed ({refused})"
        elif not gpus.mig_gpus:
            why = "a MIG instance, but no GPU of this node is in MIG mode"
        else:
            shown = ", ".join(str(i) for i in gpus.mig_gpus)
            why = f"a MIG instance, but not one of those of GPU(s) {shown} (in MIG mode)"
        self._once(
            hello,
            "unknown",
            "GPU UUID %s is %s; keeping GPU index %s (a launcher can set "
            "TRAINGUARD_GPU_INDEX to the node's NVML index)",
            hello.gpu_uuid,
            why,
            hello.gpu_index,
        )

    def _once(self, hello: LocalHello, kind: str, message: str, *args: object) -> None:
        """Log ``message`` for the first rank of a job it applies to (the others are alike).
        A moved index or a MIG slice is the normal case on Kubernetes (info); an unknown UUID
        is not."""
        if (hello.job, kind) in self._said:
            return
        if len(self._said) >= _PLACEMENT_LOG_JOBS:
            self._said.clear()
        self._said.add((hello.job, kind))
        level = logging.WARNING if kind == "unknown" else logging.INFO
        log.log(
            level, "job %s rank %d: " + message + " (once per job)", hello.job, hello.rank, *args
        )


@dataclass(slots=True)
class _PlacementInventory:
    """The inventory as :class:`GpuPlacer` matches it, read afresh at each hello."""

    #: Canonical UUID of each whole GPU -> its NVML index.
    whole: dict[str, int] = field(default_factory=dict)
    #: Bare UUID (no ``mig-`` prefix) of each listed MIG instance -> its parent's index.
    mig: dict[str, int] = field(default_factory=dict)
    #: GPUs in MIG mode, whether or not their instances could be listed.
    mig_gpus: list[int] = field(default_factory=list)
    #: GPU index -> why its MIG instances could not be listed.
    refused: dict[int, str] = field(default_factory=dict)


def _bare_uuid(canonical: str) -> str:
    """A canonical UUID without its ``gpu-`` or ``mig-`` prefix (the 8-4-4-4-12 hex)."""
    return canonical[4:] if canonical.startswith(("gpu-", "mig-")) else canonical


def canonical_uuid(value: str) -> str:
    """A GPU UUID in one spelling for matching: lower case, NVML's ``gpu-`` prefix added to
    a bare 8-4-4-4-12 UUID (the form ``str()`` of torch's and Python's UUIDs takes)."""
    text = value.strip().lower()
    if len(text) == 36 and text.count("-") == 4 and not text.startswith(("gpu-", "mig-")):
        return "gpu-" + text
    return text


def on_gpu(records: JobRecords, index: int) -> JobRecords:
    """``records`` with the rank's steps and events on GPU ``index`` (the agent's number)."""
    moved = {"gpu_index": index}
    steps = [s if s.gpu_index == index else s.model_copy(update=moved) for s in records.steps]
    events = [
        e if e.gpu_index == index else e.model_copy(update=moved) for e in records.rank_events
    ]
    return records.model_copy(update={"steps": steps, "rank_events": events})


def _peer_credentials(conn: socket.socket) -> tuple[int | None, int | None]:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # not Linux
        return None, None
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


def process_state(pid: int | None) -> str:
    """``alive``, ``gone`` (no such process, or a zombie) or ``unknown`` (pid not visible)."""
    if pid is None or pid <= 0:  # SO_PEERCRED gives 0 for a peer in an invisible pid namespace
        return "unknown"
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:
            return "alive"  # exists, not ours to signal
        return "alive"
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ")".
    state = stat_line.rpartition(")")[2].split()[:1]
    return "gone" if state and state[0] in ("Z", "X", "x") else "alive"


def _oversized_trace(records: JobRecords) -> str | None:
    """Why a Flight Recorder dump of this frame is refused (too large for a report), if so."""
    for dump in records.traces:
        size = report_size(dump)
        if size > MAX_TRACE_BYTES:
            return (
                f"Flight Recorder dump of rank {dump.rank} is {size} bytes; the agent takes at "
                f"most {MAX_TRACE_BYTES} per dump (a report is at most {MAX_REPORT_BYTES}): "
                "lower trace_max_entries; the frame was refused"
            )
    return None


def _foreign_job(records: JobRecords, job: str) -> str | None:
    for group in (
        records.steps,
        records.peer_groups,
        records.inflight,
        records.rank_events,
        records.checkpoints,
        records.probes,
    ):
        for record in group:
            if record.job != job:
                return record.job
    return None


__all__ = [
    "IDLE_TIMEOUT_S",
    "MAX_CLIENTS",
    "SOCKET_MODE",
    "VANISH_GRACE_S",
    "GpuInventory",
    "GpuPlacer",
    "LocalEndpoint",
    "Session",
    "canonical_uuid",
    "on_gpu",
    "process_state",
]
