"""Authenticate before parsing: the outermost check on every ``/api/`` request.

Why a plain ASGI layer and not a FastAPI dependency: FastAPI reads and parses a request's
body before it solves the route's dependencies, so a client without a token could make the
controller read (up to the size cap) and run the JSON parser and validators on whatever it
sends, and would learn from a 400/422 what the body looked like to the server. Here the
``Authorization`` header is checked before the body is received at all: no valid token,
401, whatever the body, and nothing downstream (the body cap, the report fast path, the
JSON parser) runs. Roles are still checked by each route (403); this layer only answers
"is this a credential the controller knows".

Anonymous reads (``allow_anonymous_read``) pass only for ``GET``/``HEAD`` without any
``Authorization`` header; a header with an unknown token is 401 even then. A request with
more than one ``Authorization`` (or ``X-Trainguard-Token``) header is 400, whatever they hold.
A credential longer than ``controller.auth.MAX_TOKEN_CHARS`` is 401 without being hashed or
sent to a TokenReview.

Every ``/api/`` response, refusals included, also carries ``X-Content-Type-Options:
nosniff`` and, unless the route set its own, ``Cache-Control: no-store``: answers are
per-credential JSON that no browser or proxy should sniff or keep (nothing here uses
ETags or revalidation).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.api.deps import PROXIED_TOKEN_HEADER, Replica
from controller.api.handlers import payload_too_large
from controller.auth import MISSING_TOKEN, check_length
from controller.errors import (
    ClientError,
    ControllerError,
    InvalidInput,
    MalformedBody,
    Unauthenticated,
)
from controller.services.agent_identity import IdentityResolver
from controller.validation import json_body_problem
from trainguard.wire import API_PREFIX

READ_METHODS = frozenset({"GET", "HEAD"})
_PROXIED = PROXIED_TOKEN_HEADER.encode()
_NOSNIFF = (b"x-content-type-options", b"nosniff")
_NO_STORE = (b"cache-control", b"no-store")
REPEATED_CREDENTIAL = (
    f"the Authorization (or {PROXIED_TOKEN_HEADER}) header is given more than once; send one"
)


def _api_headers(send: Send) -> Send:
    """``send`` that adds the API's security headers to the response start."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            names = {name.lower() for name, _ in headers}
            if b"x-content-type-options" not in names:
                headers.append(_NOSNIFF)
            if b"cache-control" not in names:
                headers.append(_NO_STORE)
            message = {**message, "headers": headers}
        await send(message)

    return sending


class AuthGate:
    """401 before the body is read for any ``/api/`` request without a known token."""

    def __init__(self, app: ASGIApp, *, controller: Replica, resolver: IdentityResolver) -> None:
        self.app = app
        self.services = controller.services
        self.resolver = resolver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        send = _api_headers(send)
        authorization: str | None = None
        proxied: str | None = None
        repeated = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                repeated = repeated or authorization is not None
                authorization = value.decode("latin-1")
            elif name == _PROXIED:
                repeated = repeated or proxied is not None
                proxied = value.decode("latin-1")
        if not authorization and proxied:
            authorization = f"Bearer {proxied}"
        try:
            if repeated:
                # Which one counts would be a guess (the routes read the first, this loop the
                # last): refused, before the body, as RFC 6750 says (400 invalid_request).
                raise ClientError(REPEATED_CREDENTIAL)
            if authorization is None:
                anonymous_ok = self.services.auth.allow_anonymous_read
                if not (anonymous_ok and scope["method"] in READ_METHODS):
                    raise Unauthenticated(MISSING_TOKEN)
            else:
                # Too long for any credential: 401 before hashing or a TokenReview.
                check_length(authorization)
                # Resolves Kubernetes service-account tokens (TokenReview, cached) so the
                # routes' synchronous role checks find them; raises for unknown tokens.
                await self.resolver.resolve(authorization)
            _check_target(scope)
        except ControllerError as exc:
            await _refuse(send, exc)
            return
        await self.app(scope, receive, send)


def _check_target(scope: Scope) -> None:
    """Path and query parameters carry no NUL (PostgreSQL text cannot hold one, and a
    lookup with one would be a 5xx there and a silent miss on SQLite). Percent-decoding
    replaces invalid UTF-8, so no lone surrogate can arrive this way."""
    query: bytes = scope.get("query_string", b"")
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8", "replace")
    for where, raw in (("query", query), ("path", raw_path)):
        if b"%00" in raw or b"\x00" in raw:
            raise InvalidInput(f"{where}: parameters must not contain NUL characters")


async def _refuse(send: Send, exc: ControllerError) -> None:
    body = json.dumps({"detail": exc.message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # The body was never read: the connection cannot carry another request.
        (b"connection", b"close"),
    ]
    if exc.status_code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class BodyCap:
    """Refuse bodies over ``max_bytes`` with 413: by ``Content-Length`` before reading, and
    for chunked bodies (no length) by reading them whole before the app sees them.

    Why read first: an error raised from ``receive`` in the middle of FastAPI's body parsing
    comes out as its generic 400 ("error parsing the body"), not as 413. Every route reads
    the whole body anyway, so holding it here (at most ``max_bytes``) costs nothing extra.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    await _refuse(send, MalformedBody("Content-Length is not a number"))
                    return
                if int(value) > self.max_bytes:
                    await _refuse(send, payload_too_large(self.max_bytes))
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, payload_too_large(self.max_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        problem = json_body_problem(b"".join(chunks))
        if problem is not None:
            await _refuse(send, InvalidInput(problem))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
