"""A controller stopping with dashboards open: every live stream ends at once and cleanly.

The acceptance probe found that each open ``/api/v1/stream`` held the stop for uvicorn's
whole ``timeout_graceful_shutdown`` and then logged an ``Exception in ASGI application``
(``CancelledError``) traceback per stream: uvicorn sends the lifespan shutdown only after
open responses end, and a stream never ended by itself. Also here: the API's security
headers (``nosniff``, ``no-store``), which the probe found missing on JSON answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controller.server import uvicorn_config
from controller.services.dashboard import CLOSE, QUEUE_MAX, RESYNC, DashboardFeed
from controller.state import ClusterState
from tests import http_calls
from trainguard.wire import API_PREFIX

STREAMS = 3


class _NoDb:
    async def read(self, fn: Any) -> Any:
        return ((None, None), None)


def _open_stream(client: httpx.Client, live: Any) -> tuple[httpx.Response, Iterator[str]]:
    """A stream past its first snapshot (the feed has it as a subscriber), and its lines
    (kept: dropping the iterator would close the response)."""
    request = client.build_request("GET", f"{live.url}{API_PREFIX}/stream", headers=live.headers())
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    for line in lines:
        if line == "event: nodes":
            break
    return response, lines


def test_open_streams_end_at_once_when_the_controller_stops(
    live_controller: Any, caplog: pytest.LogCaptureFixture
) -> None:
    live = live_controller
    graceful_s = uvicorn_config(live.app, live.settings).timeout_graceful_shutdown
    assert graceful_s is not None and graceful_s >= 1
    caplog.set_level(logging.INFO)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(http_calls.client(timeout=graceful_s * 3))
        streams = [_open_stream(client, live) for _ in range(STREAMS)]
        for response, _ in streams:
            stack.callback(response.close)
        assert len(live.controller.services.dashboard.subscribers) == STREAMS

        started = time.monotonic()
        live.stop()
        took = time.monotonic() - started

        # Each response ended with its last chunk (no reset, no truncated body).
        for response, lines in streams:
            rest = list(lines)
            assert all(not line.startswith("event: ") or line == "event: ping" for line in rest)
            assert response.is_closed
    assert took < graceful_s / 4, f"stop took {took:.1f} s of a {graceful_s} s grace period"
    logged = "\n".join(
        f"{r.name}: {r.getMessage()} {r.exc_info!r}" for r in caplog.records if r.levelno >= 30
    )
    assert "Exception in ASGI application" not in logged
    assert "timeout graceful shutdown exceeded" not in logged
    assert "CancelledError" not in logged


def test_a_closed_feed_ends_every_subscriber_and_every_later_one() -> None:
    async def run() -> None:
        feed = DashboardFeed(ClusterState(), _NoDb(), None)
        behind = feed.subscribe()
        for _ in range(QUEUE_MAX + 1):  # overflowed: the queue holds RESYNC
            feed._broadcast(b"event: nodes\ndata: {}\n\n")
        assert list(behind.queue._queue) == [RESYNC]  # type: ignore[attr-defined]
        idle = feed.subscribe()
        feed._broadcast(b"event: nodes\ndata: {}\n\n")
        assert idle.queue.qsize() == 1 and behind.queue.qsize() == 2
        task = feed._task
        assert task is not None

        feed.close()
        # What they had not taken is moot (a reconnect brings a snapshot): CLOSE is next.
        for sub in (idle, behind):
            assert sub.queue.get_nowait() == CLOSE and sub.queue.empty()
            sub.queue.put_nowait(CLOSE)
        feed._broadcast(b"event: changed\ndata: {}\n\n")  # a tick after close adds nothing
        assert [s.queue.qsize() for s in (idle, behind)] == [1, 1]
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()

        late = feed.subscribe()  # e.g. a request on a kept-alive connection
        assert late.queue.get_nowait() == CLOSE and feed._task is None
        for sub in (idle, behind, late):
            feed.unsubscribe(sub)
        feed.close()  # idempotent

    asyncio.run(run())


def test_api_answers_say_nosniff_and_no_store(live_controller: Any) -> None:
    live = live_controller
    api = f"{live.url}{API_PREFIX}"
    answers = {
        "nodes": http_calls.get(f"{api}/nodes", headers=live.headers("viewer")),
        "whoami": http_calls.get(f"{api}/whoami", headers=live.headers("viewer")),
        "404": http_calls.get(f"{api}/incidents/999", headers=live.headers("viewer")),
        "401": http_calls.get(f"{api}/nodes", headers={"Authorization": "Bearer nope"}),
        "post": http_calls.post(f"{api}/incidents/999/ack", headers=live.headers("operator")),
    }
    assert {k: r.status_code for k, r in answers.items()} == {
        "nodes": 200,
        "whoami": 200,
        "404": 404,
        "401": 401,
        "post": 404,
    }
    for name, r in answers.items():
        assert r.headers.get("x-content-type-options") == "nosniff", name
        assert r.headers.get("cache-control") == "no-store", name
        assert r.headers["content-type"].startswith("application/json"), name
        assert "etag" not in r.headers, name
    # A route's own Cache-Control stands: the stream's, once.
    with http_calls.stream("GET", f"{api}/stream", headers=live.headers("viewer")) as r:
        assert r.status_code == 200
        assert r.headers.get_list("cache-control") == ["no-cache"]
        assert r.headers.get("x-content-type-options") == "nosniff"
    # The dashboard's own files keep theirs (web/routes.py), untouched by the API's.
    ui = http_calls.get(f"{live.url}/ui/")
    if ui.status_code == 200:
        assert ui.headers.get_list("cache-control") == ["no-cache"]
