"""The job-side client of the node agent (a daemon thread per rank).

Transport: the agent's Unix socket (``agent_socket``), or its TCP endpoint on the node's IP
(``agent_addr``, for pods that may not mount a hostPath) with the job token from
``agent_token_file`` in the hello; an agent that refuses the hello (a wrong token) is
announced once as a WARNING with its reason and retried like an absent one.

Protocol (``trainguard.framing``): ``hello`` once per connection, then a ``records`` frame
every ``ship_interval_s`` (empty ones too: each reply is also how commands reach the
rank); every frame gets one ``reply``. The training thread never touches the socket.

An absent agent is announced once, as a single WARNING line, and retried quietly with
exponential backoff up to ``connect_backoff_max_s``; records wait in the bounded outbox
meanwhile. A batch whose frame could not be written is put back; a batch that was written
but not answered counts as delivered (at most once: a duplicate step summary would skew
detectors more than a missing one).

:meth:`AgentClient.stop` ships its last batch with ``closing=True``: the agent then knows
the disconnect that follows is on purpose. A rank that vanishes without it (SIGKILL, the
OOM killer) is reported by the agent as an exit with an unknown cause.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from pydantic import ValidationError

from trainguard.framing import FrameError, encode_frame, read_frame
from trainguard.wire import Command, LocalHello, LocalRecords, LocalReply

from .config import InstrumentConfig, parse_agent_addr
from .outbox import Outbox

log = logging.getLogger("trainguard.collectives")


class _Refused(Exception):
    """The agent answered the hello with ok=false (e.g. a wrong job token)."""


class AgentClient:
    def __init__(
        self,
        cfg: InstrumentConfig,
        hello: LocalHello,
        outbox: Outbox,
        on_commands: Callable[[list[Command]], None],
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.hello = hello
        self.outbox = outbox
        self.on_commands = on_commands
        self.on_tick = on_tick
        self.connected = False
        self.batches_sent = 0
        self.connect_failures = 0
        self._sock: socket.socket | None = None
        self._io = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._warned = False
        self._refusal_warned = False
        self._retry_at = 0.0
        self._backoff_s = 0.1
        self._thread = threading.Thread(target=self._run, name="trainguard-ship", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush_timeout_s: float = 1.0) -> None:
        self.flush(flush_timeout_s, closing=True)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=flush_timeout_s + self.cfg.socket_timeout_s)
        with self._io:
            self._close()

    def wake(self) -> None:
        """Ship at the next chance instead of the next interval."""
        self._wake.set()

    def flush(self, timeout_s: float = 1.0, *, closing: bool = False) -> bool:
        """Ship what is pending now, from the caller's thread; True when it reached the agent.

        ``closing``: tell the agent this connection ends on purpose right after.
        """
        if not self._io.acquire(timeout=timeout_s):
            return False
        try:
            if self._sock is None and not self._connect(force=True):
                return False
            return self._ship(closing=closing)
        finally:
            self._io.release()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.ship_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.on_tick is not None:
                    self.on_tick()
                with self._io:
                    if self._sock is not None or self._connect(force=False):
                        self._ship()
            except Exception:
                log.debug("trainguard shipping tick failed", exc_info=True)

    def _connect(self, *, force: bool) -> bool:
        clock = time.monotonic()
        if not force and clock < self._retry_at:
            return False
        sock: socket.socket | None = None
        try:
            sock = self._open_socket()
            sock.sendall(encode_frame(self._hello_payload()))
            reply = self._read_reply(sock)
            if not reply.ok:
                raise _Refused(reply.error)
        except (OSError, FrameError, ValidationError, _Refused) as exc:
            if sock is not None:
                sock.close()
            self.connect_failures += 1
            self._retry_at = clock + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.cfg.connect_backoff_max_s)
            if isinstance(exc, _Refused) and not self._refusal_warned:
                self._refusal_warned = True
                log.warning(
                    "trainguard: the node agent at %s refused this rank (%s); training "
                    "continues unmonitored, retrying quietly",
                    self.agent_location,
                    exc,
                )
            elif not isinstance(exc, _Refused) and not self._warned:
                self._warned = True
                log.warning(
                    "trainguard: no node agent at %s (%s); training continues unmonitored, "
                    "retrying quietly",
                    self.agent_location,
                    getattr(exc, "strerror", None) or exc,
                )
            return False
        self._sock = sock
        self.connected = True
        self._backoff_s = 0.1
        self.outbox.registered()  # a new registration: peer groups are declared again
        log.info("trainguard: connected to node agent at %s", self.agent_location)
        self._deliver(reply)
        return True

    @property
    def agent_location(self) -> str:
        """Where this client looks for its agent, for messages."""
        return self.cfg.agent_addr or self.cfg.agent_socket

    def _open_socket(self) -> socket.socket:
        """A connected socket: TCP when ``agent_addr`` is set, else the Unix socket."""
        if self.cfg.agent_addr:
            host, port = parse_agent_addr(self.cfg.agent_addr)
            sock = socket.create_connection((host, port), timeout=self.cfg.socket_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.cfg.socket_timeout_s)
        try:
            sock.connect(self.cfg.agent_socket)
        except OSError:
            sock.close()
            raise
        return sock

    def _hello_payload(self) -> bytes:
        """The hello, with the job token over TCP (read now: a rotated Secret applies)."""
        hello = self.hello
        if self.cfg.agent_addr:
            with open(self.cfg.agent_token_file, encoding="utf-8", errors="replace") as fh:
                token = next((line.strip() for line in fh if line.strip()), "")
            hello = hello.model_copy(update={"token": token})
        return hello.model_dump_json().encode()

    def _ship(self, *, closing: bool = False) -> bool:
        sock = self._sock
        if sock is None:
            return False
        batch = self.outbox.drain()
        try:
            message = LocalRecords(records=batch, closing=closing)
            frame = encode_frame(message.model_dump_json().encode())
        except FrameError:  # pragma: no cover - batches are capped far below the frame limit
            log.debug("trainguard: dropped an oversized batch")
            return False
        try:
            sock.sendall(frame)
        except OSError:
            self.outbox.requeue(batch)
            self._lost("send failed")
            return False
        self.batches_sent += 1
        try:
            reply = self._read_reply(sock)
        except (OSError, FrameError, ValidationError):
            self._lost("no reply")
            return False
        self._deliver(reply)
        return True

    @staticmethod
    def _read_reply(sock: socket.socket) -> LocalReply:
        return LocalReply.model_validate_json(read_frame(sock))

    def _deliver(self, reply: LocalReply) -> None:
        if not reply.ok:
            log.debug("trainguard: agent refused a frame: %s", reply.error)
        if reply.commands:
            self.on_commands(list(reply.commands))

    def _lost(self, why: str) -> None:
        log.info("trainguard: lost the node agent (%s); retrying quietly", why)
        self._close()
        self._retry_at = time.monotonic() + self._backoff_s

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self.connected = False


__all__ = ["AgentClient"]
