"""An HTTP webhook so a site can plug its own ticketing or repair flow into remediation.

trainguard POSTs one JSON document per action (the incident, the node or job, what it did
or asks for) to the site's URL. The receiver can trust it: the body is signed with
HMAC-SHA256 over ``<timestamp>.<body>`` with a shared secret, sent as
``X-Trainguard-Signature: sha256=<hex>`` with ``X-Trainguard-Timestamp: <unix seconds>``
(reject old timestamps to stop replays; :func:`verify` is the receiver's side, in Python).
Each attempt has a timeout; connection failures, timeouts, 429 and 5xx are retried with
exponential backoff, other 4xx are final (the receiver refused this payload: retrying sends
the same refusal). A 429 or 503 that says ``Retry-After`` (seconds or an HTTP date) waits
that long instead, up to ``backoff_max_s``: a remediation waits on its webhook, so a
receiver cannot hold it for an hour. ``X-Trainguard-Delivery`` stays the same across
retries, so a receiver can drop a duplicate.

The answer is read up to :data:`MAX_RESPONSE_BYTES`: a receiver that streams a huge (or
endless) body must not fill the controller's memory. A 2xx whose body is longer is still a
delivery (``response`` is then ``None``); the error of a failed attempt quotes at most 200
characters of its body, on one line.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from trainguard.tls import default_context

#: The most of an answer's body read (the rest is left unread and the connection closed).
MAX_RESPONSE_BYTES = 64 * 1024


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (``None``: absent or unreadable)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


async def _read_capped(answer: httpx.Response) -> bytes | None:
    """The body, or ``None`` when it is longer than :data:`MAX_RESPONSE_BYTES`."""
    body = bytearray()
    async for chunk in answer.aiter_bytes():
        body += chunk
        if len(body) > MAX_RESPONSE_BYTES:
            return None
    return bytes(body)


def _one_line(body: bytes | None) -> str:
    if body is None:
        return f"(a body over {MAX_RESPONSE_BYTES} bytes)"
    text = body[:800].decode("utf-8", "replace")
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:200]


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(
    secret: bytes,
    headers: dict[str, str],
    body: bytes,
    *,
    now: float | None = None,
    max_age_s: float = 300.0,
) -> bool:
    """The receiver's check: the signature matches and the timestamp is recent."""
    lower = {k.lower(): v for k, v in headers.items()}
    timestamp = lower.get("x-trainguard-timestamp", "")
    signature = lower.get("x-trainguard-signature", "")
    if not timestamp.isdigit():
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > max_age_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


@dataclass(slots=True)
class WebhookResult:
    ok: bool
    status: int | None
    attempts: int
    delivery: str
    error: str = ""
    response: Any = None


@dataclass(slots=True)
class Webhook:
    url: str
    #: Out of ``repr``: an object logged by mistake must not log the signing key with it.
    secret: bytes = field(repr=False)
    timeout_s: float = 5.0
    retries: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    transport: httpx.AsyncBaseTransport | None = field(default=None, repr=False)

    async def send(self, event: str, payload: dict[str, Any]) -> WebhookResult:
        """POST ``payload`` as ``event``; never raises: the result says what happened."""
        delivery = str(uuid.uuid4())
        body = json.dumps(
            {"event": event, "delivery": delivery, "payload": payload}, sort_keys=True
        ).encode()
        delay, error, status = self.backoff_initial_s, "", None
        async with httpx.AsyncClient(
            timeout=self.timeout_s, transport=self.transport, verify=default_context()
        ) as http:
            for attempt in range(1, self.retries + 2):
                timestamp = str(int(time.time()))
                headers = {
                    "Content-Type": "application/json",
                    "User-Agent": "trainguard-webhook",
                    "X-Trainguard-Event": event,
                    "X-Trainguard-Delivery": delivery,
                    "X-Trainguard-Timestamp": timestamp,
                    "X-Trainguard-Signature": sign(self.secret, timestamp, body),
                }
                wait_s: float | None = None
                try:
                    async with http.stream(
                        "POST", self.url, content=body, headers=headers
                    ) as answer:
                        status = answer.status_code
                        raw = await _read_capped(answer)
                        if status in (429, 503):
                            wait_s = retry_after_s(answer.headers.get("retry-after"))
                except httpx.HTTPError as exc:
                    status, error = None, f"{type(exc).__name__}: {exc}"[:300]
                else:
                    if 200 <= status < 300:
                        try:
                            data = None if raw is None else json.loads(raw)
                        except ValueError:
                            data = None
                        return WebhookResult(True, status, attempt, delivery, response=data)
                    error = f"HTTP {status}: {_one_line(raw)}"
                    if status != 429 and status < 500:
                        return WebhookResult(False, status, attempt, delivery, error)
                if attempt <= self.retries:
                    await self.sleep(delay if wait_s is None else min(wait_s, self.backoff_max_s))
                    delay = min(delay * 2, self.backoff_max_s)
        return WebhookResult(False, status, self.retries + 1, delivery, error)


__all__ = ["MAX_RESPONSE_BYTES", "Webhook", "WebhookResult", "retry_after_s", "sign", "verify"]
