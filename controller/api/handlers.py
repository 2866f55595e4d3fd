"""The one place exceptions become HTTP responses (the body cap is ``middleware.BodyCap``)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.db.errors import database_away
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
    # The database being away is logged once by the store, not once per refused request.
    if exc.status_code >= 500 and not database_away(exc):
        log.error("request failed", extra={"fields": {"error": exc.message}})
    body: dict[str, Any] = {"detail": exc.message}
    if isinstance(exc, InvalidInput) and exc.errors:
        body["errors"] = exc.errors
    return exc.status_code, json.dumps(body).encode(), headers


#: The agents' report route, the one whose 413 tells how to send less.
def payload_too_large(max_bytes: int, *, reports: bool = False) -> PayloadTooLarge:
    """413 for a body over ``max_bytes``. Only the agents' report route (``reports``) gets
    the hint about reports; an operator's oversized request (a power tree, a plan) is told
    the limit alone (the acceptance probe found the report hint on ``PUT /power/domains``)."""
    if reports:
        return PayloadTooLarge(
            f"body larger than {max_bytes} bytes; send smaller reports "
            "(the agent splits its spool into batches)"
        )
    return PayloadTooLarge(f"request body larger than {max_bytes} bytes; send a smaller one")


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
