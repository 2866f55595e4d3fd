"""Framing on the agent's local Unix socket, shared by the agent (server) and job-side code.

Each frame is a 4-byte big-endian unsigned length followed by that many bytes of UTF-8 JSON
(one object: a :class:`trainguard.wire.LocalHello`, :class:`~trainguard.wire.LocalRecords`
or :class:`~trainguard.wire.LocalReply`). Length-prefixing, rather than newline-delimited
JSON, lets the reader allocate once and refuse an oversized frame before reading it.

Conversation: the client sends ``hello`` once, then any number of ``records`` frames; the
agent answers every frame with exactly one ``reply`` (carrying pending job commands), so
the client always knows when its batch was taken.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

#: Largest frame either side accepts. Job records are batched per ~100 ms per rank, far
#: below this; a larger length means a corrupt or hostile stream.
MAX_FRAME_BYTES = 8 * 1024 * 1024

_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The byte stream is not valid framing (oversized, truncated); drop the connection."""


def encode_frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def _check_length(length: int, limit: int = MAX_FRAME_BYTES) -> int:
    if length > limit:
        raise FrameError(f"peer announced a {length}-byte frame (limit {limit})")
    return length


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        if deadline is not None:
            # One deadline for the whole frame, not a timeout per recv: a peer trickling a
            # byte at a time must not restart the clock with every byte.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("frame not complete by its deadline")
            sock.settimeout(remaining)
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise FrameError("connection closed mid-frame" if chunks else "connection closed")
        chunks += chunk
    return bytes(chunks)


def read_frame(
    sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, *, deadline: float | None = None
) -> bytes:
    """Read one frame from a blocking socket (raises :class:`FrameError` on EOF).

    ``max_bytes`` lowers the limit, e.g. for a peer that has not authenticated yet.
    ``deadline`` (a :func:`time.monotonic` instant) bounds the whole frame, header and body:
    :class:`TimeoutError` when it is not complete by then, however the bytes trickle in (the
    socket's timeout is changed to what remains before each ``recv``).
    """
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    return _recv_exact(sock, _check_length(length, max_bytes), deadline) if length else b""


async def read_frame_async(reader: asyncio.StreamReader) -> bytes:
    """Read one frame from an asyncio stream (raises :class:`FrameError` on EOF)."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (length,) = _HEADER.unpack(header)
        return await reader.readexactly(_check_length(length)) if length else b""
    except asyncio.IncompleteReadError as exc:
        raise FrameError(
            "connection closed mid-frame" if exc.partial else "connection closed"
        ) from exc


__all__ = ["MAX_FRAME_BYTES", "FrameError", "encode_frame", "read_frame", "read_frame_async"]
