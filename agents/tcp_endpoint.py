"""The agent's authenticated TCP listener for ranks, beside (or instead of) the Unix socket.

Why it exists: a Unix socket shared between the agent's pod and a training pod needs a
``hostPath`` volume in the training pod, which the Pod Security ``baseline`` level forbids.
Over TCP a rank reaches its node's agent at ``<node IP>:<port>`` (the agent's container
publishes the port as a ``hostPort``; the rank learns the node IP from the downward API's
``status.hostIP``), so the training pod needs no volume, no host namespace and no privilege.

Same framing and messages as the Unix socket (:mod:`trainguard.framing`,
:mod:`agents.local_endpoint`), plus one rule: the ``hello`` must carry a job token that
matches one of the tokens in :attr:`TcpListen.token_file` (a mounted Secret: one token per
line, so a rotation can list the old and the new token for a while). A Unix socket is
guarded by its file mode; a TCP port is reachable by every pod that can route to the node,
so a peer that has not authenticated gets a small frame limit (:data:`HELLO_MAX_BYTES`), a
short deadline for its hello (:attr:`TcpListen.hello_timeout_s`) and a bounded number of
seats (:data:`MAX_UNAUTHENTICATED`); a wrong or missing token gets one ``ok=false`` reply
naming the fix, and the connection is closed. Tokens are compared in constant time
(:func:`hmac.compare_digest`) and never logged.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from agents.errors import ListenError
from trainguard.textfile import Unreadable, read_text

log = logging.getLogger(__name__)

#: Largest frame a peer may send before it has authenticated: a hello is well under 1 KiB.
HELLO_MAX_BYTES = 64 * 1024
#: Connections that have not (yet) sent a good hello, at once; more are refused so a flood
#: of idle connections cannot take the seats of the node's ranks.
MAX_UNAUTHENTICATED = 32
#: Shortest token accepted in the token file: 16 characters (``openssl rand -hex 24`` gives 48).
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class TcpListen:
    """Where and how the TCP listener accepts ranks."""

    host: str
    """Address to bind in the agent's network namespace (``0.0.0.0`` in a pod: the hostPort
    forwards the node IP's port to it)."""
    port: int
    """TCP port; 0 picks a free one (tests)."""
    token_file: Path
    """File of accepted job tokens, one per line; re-read when it changes (a Secret update)."""
    hello_timeout_s: float = 5.0
    """Seconds a new connection has to send its hello before it is closed."""


class JobTokens:
    """The accepted job tokens, re-read from their file whenever its mtime or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._tokens: list[bytes] = []

    def load(self) -> list[bytes]:
        """Read the file now; raises :class:`ListenError` when it has no usable token."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return self._tokens
            text = read_text(self.path)
        except (OSError, Unreadable) as exc:
            why = exc.reason if isinstance(exc, Unreadable) else exc.strerror or type(exc).__name__
            raise ListenError(f"job token file {self.path}: cannot read it ({why})") from None
        tokens = [line.strip().encode() for line in text.splitlines() if line.strip()]
        short = [t for t in tokens if len(t) < MIN_TOKEN_CHARS]
        if not tokens or short:
            raise ListenError(
                f"job token file {self.path}: needs one token per line, each at least "
                f"{MIN_TOKEN_CHARS} characters (make one with `openssl rand -hex 24`)"
            )
        self._stamp, self._tokens = stamp, tokens
        return tokens

    def check(self, presented: str) -> bool:
        """Constant-time match of ``presented`` against every accepted token."""
        try:
            tokens = self.load()
        except ListenError as exc:  # a Secret being rewritten: keep the last good set
            if not self._tokens:
                log.error("%s; refusing TCP clients", exc)
                return False
            tokens = self._tokens
        candidate = presented.encode()
        ok = False
        for token in tokens:  # no early exit: the time does not tell which token matched
            ok |= hmac.compare_digest(candidate, token)
        return ok and bool(presented)


def bind_tcp(listen: TcpListen) -> socket.socket:
    """A listening socket for ``listen`` (IPv4 or IPv6 from the host's form)."""
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((listen.host, listen.port))
    except OSError as exc:
        server.close()
        raise ListenError(
            f"job endpoint {listen.host}:{listen.port}: cannot listen ({exc.strerror or exc}); "
            "pick another TRAINGUARD_AGENT_JOB_LISTEN port"
        ) from None
    server.listen(64)
    server.settimeout(0.2)
    return server


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); raises ValueError with the rule."""
    host, sep, port_text = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError("must be HOST:PORT, e.g. 0.0.0.0:9471 or [::]:9471")
    return host, int(port_text)


__all__ = [
    "HELLO_MAX_BYTES",
    "MAX_UNAUTHENTICATED",
    "MIN_TOKEN_CHARS",
    "JobTokens",
    "TcpListen",
    "bind_tcp",
    "parse_listen",
]
