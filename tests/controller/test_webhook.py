"""The remediation webhook against a real HTTP receiver on an ephemeral port."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controller.services.webhook import Webhook, verify

SECRET = b"s3cret"


class Receiver:
    """Answers the queued statuses in order (then 200), verifying every signature."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.seen: list[tuple[dict[str, str], bytes, bool]] = []
        self.delay_s = 0.0


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = dict(self.headers.items())
            rec.seen.append((headers, body, verify(SECRET, headers, body)))
            if rec.delay_s:
                threading.Event().wait(rec.delay_s)
            status = rec.statuses.pop(0) if rec.statuses else 200
            answer = json.dumps({"ticket": "OPS-1"} if status == 200 else {"error": "no"})
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and left: what the timeout test wants

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield rec, f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


async def no_sleep(_: float) -> None:
    return None


def test_signed_delivery_retried_on_5xx_with_the_same_delivery_id(
    receiver: tuple[Receiver, str],
) -> None:
    rec, url = receiver
    rec.statuses = [503, 500]
    hook = Webhook(url, SECRET, retries=3, sleep=no_sleep)
    result = asyncio.run(hook.send("node.quarantined", {"node": "gpu-a", "reason": "xid 79"}))
    assert result.ok and result.attempts == 3 and result.response == {"ticket": "OPS-1"}
    assert all(ok for _, _, ok in rec.seen)  # every attempt correctly signed
    assert {h["X-Trainguard-Delivery"] for h, _, _ in rec.seen} == {result.delivery}
    doc = json.loads(rec.seen[0][1])
    assert doc["event"] == "node.quarantined" and doc["payload"]["node"] == "gpu-a"
    # A tampered body or a wrong secret does not verify; neither does an old timestamp.
    headers, body, _ = rec.seen[0]
    assert not verify(SECRET, headers, body.replace(b"gpu-a", b"gpu-b"))
    assert not verify(b"other", headers, body)
    assert not verify(SECRET, headers, body, now=int(headers["X-Trainguard-Timestamp"]) + 301)


def test_4xx_is_final_and_retries_are_bounded(receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    rec.statuses = [400]
    result = asyncio.run(Webhook(url, SECRET, retries=3, sleep=no_sleep).send("x", {}))
    assert not result.ok and result.attempts == 1 and result.status == 400
    rec.statuses = [500] * 5
    result = asyncio.run(Webhook(url, SECRET, retries=2, sleep=no_sleep).send("x", {}))
    assert not result.ok and result.attempts == 3 and "HTTP 500" in result.error


def test_timeout_counts_as_a_failed_attempt(receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    rec.delay_s = 0.5
    result = asyncio.run(
        Webhook(url, SECRET, timeout_s=0.1, retries=1, sleep=no_sleep).send("x", {})
    )
    assert not result.ok and result.attempts == 2 and "Timeout" in result.error
