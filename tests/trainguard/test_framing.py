"""Length-prefixed framing on the agent's Unix socket."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from trainguard import framing


def test_round_trip_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    with a, b:
        for payload in (b"", b"{}", b"x" * 100_000):
            a.sendall(framing.encode_frame(payload))
            assert framing.read_frame(b) == payload


def test_oversized_frame_is_refused_before_reading_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", framing.MAX_FRAME_BYTES + 1))
        with pytest.raises(framing.FrameError, match="limit"):
            framing.read_frame(b)
    with pytest.raises(framing.FrameError):
        framing.encode_frame(b"x" * (framing.MAX_FRAME_BYTES + 1))


def test_truncated_frame_is_an_error_not_a_short_read() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(struct.pack(">I", 10) + b"abc")
        a.close()
        with pytest.raises(framing.FrameError, match="mid-frame"):
            framing.read_frame(b)


def test_async_reader_matches_the_sync_one() -> None:
    async def scenario() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(framing.encode_frame(b"one") + framing.encode_frame(b"two"))
        reader.feed_eof()
        got = [await framing.read_frame_async(reader), await framing.read_frame_async(reader)]
        with pytest.raises(framing.FrameError, match="closed"):
            await framing.read_frame_async(reader)
        return got

    assert asyncio.run(scenario()) == [b"one", b"two"]
