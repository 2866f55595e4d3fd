"""Choosing a local TCP port that a child process will bind later.

A port handed to a child (a rank's ``MASTER_PORT``, a controller under a drill) is only
reserved in our heads until the child binds it, and on a loaded host that can be a minute
later (rank 0 imports torch first). ``bind(0)`` answers a port from the kernel's ephemeral
range, the very range every outbound connection and every other ``bind(0)`` on the host
draws from, so the port is often taken by then (CI saw rank 0 fail with EADDRINUSE and the
demo never start). Ports just below that range are handed out by nobody but explicit
choosers, so a random free one there stays free in practice; and this process does not hand
the same port out twice within five minutes (its first child may not have bound it yet).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Collection
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below this live well-known services and whatever an operator pinned
_TRIES = 200
#: Ports this process handed out, and when: not handed out again for a while, as the child
#: they went to may not have bound them yet (two jobs launched back to back).
_HANDED: dict[int, float] = {}
_HANDED_FOR_S = 300.0
_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unknown)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(
    count: int = 1,
    *,
    avoid: Collection[int] = (),
    host: str = "127.0.0.1",
    rng: random.Random | None = None,
) -> int:
    """The first of ``count`` consecutive ports free on ``host`` now, none of them in ``avoid``.

    Drawn at random below the ephemeral range; where that range starts too low to leave
    room, falls back to the kernel's choice (``bind(0)``, single ports only).
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    with _LOCK:
        now = time.monotonic()
        for port, when in list(_HANDED.items()):
            if now - when > _HANDED_FOR_S:
                del _HANDED[port]
        base = _choose(count, set(avoid) | set(_HANDED), host, rng or random.Random())
        _HANDED.update(dict.fromkeys(range(base, base + count), now))
    return base


def _choose(count: int, avoid: Collection[int], host: str, rng: random.Random) -> int:
    high = _ephemeral_low() - count
    if high > _LOWEST:
        for _ in range(_TRIES):
            base = rng.randrange(_LOWEST, high + 1)
            run = range(base, base + count)
            if not any(p in avoid for p in run) and all(_bindable(p, host) for p in run):
                return base
    if count == 1:
        for _ in range(_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in avoid:
                return port
    raise RuntimeError(f"no {count} consecutive free ports on {host} below {high + count}")


def free_port(*, avoid: Collection[int] = (), host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now, outside the ephemeral range where it can be."""
    return free_ports(1, avoid=avoid, host=host)


__all__ = ["free_port", "free_ports"]
