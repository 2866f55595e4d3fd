"""The remediation webhook against a real HTTP receiver on an ephemeral port."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controller.services.webhook import MAX_RESPONSE_BYTES, Webhook, retry_after_s, verify

SECRET = b"s3cret"


class Receiver:
    """Answers the queued statuses in order (then 200), verifying every signature."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.seen: list[tuple[dict[str, str], bytes, bool]] = []
        self.delay_s = 0.0
        #: Headers added to every answer; a body that replaces the JSON answer; or an
        #: endless one (written until the client goes away).
        self.headers: dict[str, str] = {}
        self.body: bytes | None = None
        self.endless = False


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
            raw = answer.encode() if rec.body is None else rec.body
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in rec.headers.items():
                    self.send_header(name, value)
                if rec.endless:
                    self.end_headers()  # no length: the body ends when the connection does
                    while True:
                        self.wfile.write(b"x" * 65536)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
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


def test_retry_after_is_honoured_up_to_the_longest_backoff(receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    waits: list[float] = []

    async def record(s: float) -> None:
        waits.append(s)

    rec.statuses, rec.headers = [429, 503, 503], {"Retry-After": "3"}
    result = asyncio.run(
        Webhook(url, SECRET, retries=3, backoff_max_s=10.0, sleep=record).send("x", {})
    )
    assert result.ok and result.attempts == 4
    assert waits == [3.0, 3.0, 3.0]  # not the 0.5 s doubling backoff
    waits.clear()
    rec.statuses, rec.headers = [503], {"Retry-After": "86400"}
    asyncio.run(Webhook(url, SECRET, retries=1, backoff_max_s=10.0, sleep=record).send("x", {}))
    assert waits == [10.0]  # a receiver cannot hold a remediation for a day
    waits.clear()
    rec.statuses, rec.headers = [500], {"Retry-After": "7"}
    asyncio.run(Webhook(url, SECRET, retries=1, sleep=record).send("x", {}))
    assert waits == [0.5]  # Retry-After counts on 429 and 503 only


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("120") == 120.0
    assert retry_after_s(" 5 ") == 5.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0  # past
    for bad in (None, "", "soon", "-5", "1.5", "Wed, 99 Foo 2015"):
        assert retry_after_s(bad) is None


def test_a_huge_or_endless_answer_is_not_read_into_memory(receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    rec.body = b'{"ticket": "' + b"A" * (4 * MAX_RESPONSE_BYTES) + b'"}'
    result = asyncio.run(Webhook(url, SECRET, retries=0, sleep=no_sleep).send("x", {}))
    assert result.ok and result.status == 200 and result.response is None  # delivered
    rec.body, rec.endless = None, True
    result = asyncio.run(
        asyncio.wait_for(Webhook(url, SECRET, retries=0, sleep=no_sleep).send("x", {}), 30)
    )
    assert result.ok and result.response is None


def test_a_failed_answer_is_quoted_on_one_short_line(receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    rec.statuses = [400]
    rec.body = b"bad\r\nX-Injected: yes\x1b[31m " + "\u202e".encode() + b"!" * 5000
    result = asyncio.run(Webhook(url, SECRET, retries=0, sleep=no_sleep).send("x", {}))
    assert not result.ok and result.status == 400
    assert result.error.startswith("HTTP 400: bad X-Injected: yes [31m")
    assert "\n" not in result.error and "\x1b" not in result.error and "\u202e" not in result.error
    assert len(result.error) <= len("HTTP 400: ") + 200
