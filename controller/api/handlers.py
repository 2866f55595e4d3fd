"""The one place exceptions become HTTP responses, and the request-body size cap."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.errors import ControllerError, InvalidInput, PayloadTooLarge, TemporaryError
from controller.validation import one_line, structured

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ControllerError, _controller_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


def error_payload(exc: ControllerError) -> tuple[int, bytes, dict[str, str]]:
    """Status, JSON body and extra headers for one of our exceptions (the one mapping)."""
    headers: dict[str, str] = {}
    if isinstance(exc, TemporaryError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status_code >= 500:
        log.error("request failed", extra={"fields": {"error": exc.message}})
    body: dict[str, Any] = {"detail": exc.message}
    if isinstance(exc, InvalidInput) and exc.errors:
        body["errors"] = exc.errors
    return exc.status_code, json.dumps(body).encode(), headers


def payload_too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"body larger than {max_bytes} bytes; send smaller reports "
        "(the agent splits its spool into batches)"
    )


async def _controller_error(_request: Request, exc: ControllerError) -> Response:
    status, body, headers = error_payload(exc)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors: list[dict[str, Any]] = list(exc.errors())
    status = 422
    if errors and errors[0].get("type") == "json_invalid":
        status = 400
    return JSONResponse(
        {"detail": one_line(errors), "errors": structured(errors)}, status_code=status
    )


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        {"detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", extra={"fields": {"path": request.url.path}})
    return JSONResponse(
        {"detail": "internal error; the controller log has the details"}, status_code=500
    )


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes``: by ``Content-Length`` before reading anything, and
    by counting for chunked bodies that lie or have no length."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _reply(send, 400, "Content-Length is not a number")
                    return
                if length > self.max_bytes:
                    await _reply(send, 413, self._message())
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise payload_too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return payload_too_large(self.max_bytes).message


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
