"""Sending spooled reports to the controller, oldest first, until each is acknowledged.

One thread, one request in flight, so reports arrive in seq order. Outcomes:

* 200 with a valid :class:`~trainguard.wire.ReportReply` for this seq (``duplicate`` or
  not): the report is delivered; delete it from the spool, hand the reply's commands on.
* 408, 429, 5xx, timeouts, refused or dropped connections: the controller is busy or away;
  retry the same report after an exponential backoff with full jitter (AWS architecture
  blog, "Exponential Backoff and Jitter"): ``uniform(0, min(cap, base * 2**failures))``, at
  least ``Retry-After`` when the server sends one. Full jitter spreads 2,000 agents that
  lost the controller at the same moment over the whole window instead of in waves.
* 401, 403, 404: the agent is misconfigured (token, role or URL), the report itself is
  fine; keep it, log once, retry with the capped backoff so fixing the controller's token
  list brings everything in.
* any other 4xx (400, 413, 422, ...): the report itself is bad and would fail forever;
  move it to ``rejected/`` with the reason, log once, go on with the next one.

The bearer token is sent in a header and never logged: a token that could not travel in
a header (a line break or a space inside it) is refused before any request, and an error
message that might quote the header (httpx's ``LocalProtocolError`` does) is redacted
before it reaches the log.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from pydantic import TypeAdapter, ValidationError

from agents.errors import AgentConfigError
from agents.spool import Spool
from agents.stats import AgentStats
from trainguard.textfile import MAX_SECRET_BYTES, Unreadable, read_text
from trainguard.tls import default_context
from trainguard.wire import API_PREFIX, Command, ReportReply

log = logging.getLogger(__name__)

Outcome = Literal["delivered", "retry", "config", "rejected"]

_RETRY_STATUSES = frozenset({408, 425, 429})
_CONFIG_STATUSES = frozenset({401, 403, 404})


@dataclass(kw_only=True, slots=True)
class BackoffPolicy:
    """Delays between failed attempts (full jitter)."""

    #: First retry waits up to this long (s).
    base_s: float = 0.5
    #: No wait exceeds this (s); 30 s keeps a recovered controller's catch-up quick.
    max_s: float = 30.0
    #: Floor so a zero draw does not hammer a struggling server.
    min_s: float = 0.05

    def delay_s(
        self, failures: int, rng: random.Random, retry_after_s: float | None = None
    ) -> float:
        ceiling = min(self.max_s, self.base_s * 2 ** min(failures, 30))
        delay = max(self.min_s, rng.uniform(0, ceiling))
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.max_s))
        return delay


def classify(status: int) -> Outcome:
    if status == 200:
        return "delivered"
    if status in _RETRY_STATUSES or status >= 500:
        return "retry"
    if status in _CONFIG_STATUSES:
        return "config"
    return "rejected"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
        detail = body.get("detail") if isinstance(body, dict) else None
        text = str(detail) if detail is not None else response.text
    except ValueError:
        text = response.text
    return " ".join(text.split())[:300]


_COMMAND = TypeAdapter(Command)

#: What an HTTP library may quote of the Authorization header in an error message.
_BEARER = re.compile(r"Bearer\s+[^\s'\"]+", re.IGNORECASE)


class InvalidTokenError(AgentConfigError):
    """The token holds characters no HTTP header can carry, or its file is a FIFO, a
    device, a directory or far too large: a configuration mistake to fix, never a file
    being rewritten (the kubelet swaps a projected token in one step), so the agent
    refuses to start on it even when it waits out a token file not written yet."""


def check_token(token: str, source: str) -> str:
    """``token`` when it can travel in an ``Authorization`` header (visible ASCII, nothing
    else), else :class:`InvalidTokenError` naming ``source``. The message never repeats the
    token: it is a secret. A line break inside would otherwise reach the first request and
    fail it with an error that quotes the whole header."""
    if not all("!" <= char <= "~" for char in token):
        raise InvalidTokenError(
            f"{source}: invalid token: it may hold only visible ASCII characters, "
            "no spaces or line breaks inside it"
        )
    return token


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every bearer credential and every one of ``secrets`` blanked out."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return _BEARER.sub("Bearer <redacted>", text)


def parse_reply(body: bytes) -> tuple[ReportReply, list[tuple[str, str]]]:
    """The reply with the commands this agent understands, and (id, reason) for the rest.

    Commands are validated one by one so that a newer controller's new command kind (or one
    malformed command) costs that command, not the acknowledgement of the whole report,
    which would otherwise be resent forever.
    """
    raw = json.loads(body)
    if not isinstance(raw, dict):
        raise ValueError("reply is not a JSON object")
    raw_commands = raw.pop("commands", [])
    reply = ReportReply.model_validate(raw)
    invalid: list[tuple[str, str]] = []
    for item in raw_commands if isinstance(raw_commands, list) else []:
        try:
            reply.commands.append(_COMMAND.validate_python(item))
        except ValidationError as exc:
            ident = item.get("id") if isinstance(item, dict) else None
            kind = item.get("kind") if isinstance(item, dict) else None
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            reason = f"invalid {kind or 'command'} command: {where}: {err['msg']}"
            invalid.append((str(ident)[:64] if isinstance(ident, str) and ident else "", reason))
    return reply, invalid


def read_token_file(path: Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped), or one-line
    :class:`AgentConfigError`: missing, a directory, a FIFO or a device (never opened to
    wait on), over 64 KiB, not UTF-8 text, or empty;
    :class:`InvalidTokenError` for a token with a space or a line break inside."""
    try:
        token = read_text(path, max_bytes=MAX_SECRET_BYTES).strip()
    except Unreadable as exc:
        error = InvalidTokenError if exc.special else AgentConfigError
        raise error(f"token_file {path}: {exc.reason}") from None
    if not token:
        raise AgentConfigError(f"token_file {path}: empty; it must hold the agent's token")
    return check_token(token, f"token_file {path}")


class _FileToken(httpx.Auth):
    """The bearer token from a file, re-read when the file changes (the kubelet rotates a
    projected service-account token in place)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int] | None = None
        #: The file's stamp when it last read as no usable token (warned once per version).
        self._bad_stamp: tuple[int, int] | None = None
        #: Why the file could not be opened, as last warned (once per reason, not per retry:
        #: an agent started before its token is issued retries for a minute).
        self._os_error: str | None = None
        self._token = ""

    @property
    def token(self) -> str:
        """The token last read (for redaction); empty before the first good read."""
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        stamp: tuple[int, int] | None = None
        try:
            stat = self._path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                self._token = read_token_file(self._path)
                self._stamp, self._bad_stamp = stamp, None
            if self._os_error is not None:
                log.info("agent token file readable", extra={"fields": {"file": str(self._path)}})
                self._os_error = None
        except OSError as exc:  # not there yet: the controller answers 401, we retry
            error = f"{self._path}: {exc.strerror or type(exc).__name__}"
            if error != self._os_error:
                self._os_error = error
                log.warning("agent token file unreadable", extra={"fields": {"error": error}})
        except AgentConfigError as exc:
            # Being rewritten, or rotated to something no header can carry: keep the last
            # good token and retry. The message names the file, never the token.
            if stamp != self._bad_stamp:  # once per version of the file, not per request
                self._bad_stamp = stamp
                log.warning("agent token file unreadable", extra={"fields": {"error": str(exc)}})
        if self._token:
            request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


class Reporter:
    """Drains the spool to ``POST {controller_url}/api/v1/reports`` on its own thread."""

    def __init__(
        self,
        spool: Spool,
        *,
        controller_url: str,
        token: str | None,
        stats: AgentStats,
        on_reply: Callable[[ReportReply], None],
        timeout_s: float = 10.0,
        backoff: BackoffPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        seed: int | None = None,
        on_invalid_command: Callable[[str, str], object] | None = None,
        token_file: Path | None = None,
    ) -> None:
        self._spool = spool
        self._on_invalid_command = on_invalid_command
        self._stats = stats
        self._on_reply = on_reply
        self._backoff = backoff or BackoffPolicy()
        self._rng = random.Random(seed)
        headers = {"User-Agent": "trainguard-agent"}
        if token:
            headers["Authorization"] = f"Bearer {check_token(token, 'token')}"
        self._token = token or ""
        self._file_token = None if token_file is None else _FileToken(token_file)
        self._client = httpx.Client(
            base_url=controller_url,
            headers=headers,
            timeout=timeout_s,
            transport=transport,
            auth=self._file_token,
            verify=default_context(),
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._last_problem = ""
        self.last_delay_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reporter", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A new report is spooled (or the daemon wants a retry now)."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._client.close()

    # ------------------------------------------------------------------ one attempt

    def send_oldest(self) -> Outcome | None:
        """Try the oldest spooled report once; None when the spool is empty."""
        item = self._spool.oldest()
        if item is None:
            return None
        seq, body = item
        try:
            response = self._client.post(
                f"{API_PREFIX}/reports",
                content=body,
                headers={"Content-Type": "application/json"},
            )
        except httpx.LocalProtocolError as exc:
            # The request could not even be written (h11 refused a header): not the
            # controller's fault, and the message may quote the Authorization header.
            self._fail(
                f"request refused before sending ({type(exc).__name__}: {self._redact(exc)})"
            )
            return "retry"
        except httpx.HTTPError as exc:
            self._fail(f"controller unreachable ({type(exc).__name__}: {self._redact(exc)})")
            return "retry"
        outcome = classify(response.status_code)
        if outcome == "delivered":
            try:
                reply, invalid = parse_reply(response.content)
            except (ValueError, ValidationError) as exc:
                self._fail(f"200 with an invalid ReportReply ({str(exc).splitlines()[0]})")
                return "retry"
            if reply.seq != seq:
                self._fail(f"controller acknowledged seq {reply.seq} for report {seq}")
                return "retry"
            self._spool.acknowledge(seq)
            self._stats.add("reports_sent_total")
            self._stats.last_report_ok_unix_s = time.time()
            if self._failures or self._last_problem:
                log.info("controller reachable again; report %d delivered", seq)
            self._failures, self._last_problem, self.last_delay_s = 0, "", 0.0
            if reply.duplicate:
                log.debug("report %d was already stored (duplicate)", seq)
            for command_id, reason in invalid:
                log.warning("controller sent a command this agent cannot run: %s", reason)
                if command_id and self._on_invalid_command is not None:
                    self._on_invalid_command(command_id, reason)
            self._on_reply(reply)
            return "delivered"
        if outcome == "rejected":
            reason = f"HTTP {response.status_code}: {_detail(response)}"
            log.error("controller rejected report %d (%s); moved to rejected/", seq, reason)
            self._spool.reject(seq, reason)
            self._stats.add("reports_rejected_total")
            return "rejected"
        what = (
            "check the agent token, its role and the controller URL"
            if outcome == "config"
            else "will retry"
        )
        self._fail(
            f"HTTP {response.status_code} ({_detail(response)}); {what}",
            retry_after_s=_retry_after(response),
        )
        return outcome

    def _redact(self, error: BaseException | str) -> str:
        """``error`` as text with every token this reporter has used blanked out."""
        file_token = self._file_token.token if self._file_token is not None else ""
        return redact(str(error), (self._token, file_token))

    def _fail(self, problem: str, *, retry_after_s: float | None = None) -> None:
        self._stats.add("report_failures_total")
        self._failures += 1
        self.last_delay_s = self._backoff.delay_s(self._failures, self._rng, retry_after_s)
        if problem != self._last_problem:
            # One line per kind of trouble, not one per retry.
            log.warning("report delivery failed: %s", problem)
            self._last_problem = problem

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                outcome = self.send_oldest()
            except Exception as exc:
                # The traceback is logged redacted: an exception from the HTTP stack may
                # quote the request's Authorization header.
                trace = "".join(traceback.format_exception(exc))
                log.error("reporter: unexpected error; backing off\n%s", self._redact(trace))
                self._fail("unexpected error")
                outcome = "retry"
            if outcome is None:
                self._wake.wait(timeout=1.0)
            elif outcome in ("retry", "config"):
                self._stop.wait(self.last_delay_s)


__all__ = [
    "BackoffPolicy",
    "InvalidTokenError",
    "Reporter",
    "check_token",
    "classify",
    "read_token_file",
    "redact",
]
