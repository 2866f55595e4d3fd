"""``POST /api/v1/reports``: the agents' only endpoint, and the controller's hot path.

At ~400 reports/s FastAPI's per-request machinery (middleware stack, dependency solving,
request objects) cost more CPU than storing the report, so :class:`ReportFastPath`, a plain
ASGI layer in front of the app, serves this one route itself: read the body (capped), check
the token, parse with pydantic's JSON parser in one pass, ingest, reply. The FastAPI route
below runs the same :func:`handle_report` and exists so the OpenAPI schema documents the
endpoint (it is also what answers if the fast path is not installed).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controller.api.deps import (
    AUTH_ERRORS,
    BAD_BODY,
    TOO_LARGE,
    UNAVAILABLE,
    Replica,
    ServicesDep,
    require_agent,
)
from controller.api.handlers import error_payload, payload_too_large
from controller.auth import REPORT_ROLES, Principal
from controller.errors import ControllerError, InvalidInput, MalformedBody
from controller.services.agent_identity import check_reporting_node
from controller.services.container import Services
from controller.services.ingest import parse_report
from controller.validation import json_body_problem
from trainguard import wire

log = logging.getLogger(__name__)

router = APIRouter(tags=["ingest"])

PATH = f"{wire.API_PREFIX}/reports"

INVALID: dict[int | str, dict[str, Any]] = {
    422: {
        "description": "A field the database cannot store, named by its path (never retried)",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}
        },
    }
}

REPORT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Report"}}},
    }
}


async def handle_report(services: Services, body: bytes, principal: Principal) -> bytes:
    """Parse, check the agent may speak for the report's node, store, and return the JSON
    reply (the role already checked)."""
    try:
        report = parse_report(body)
    except MalformedBody:
        # pydantic's JSON parser refuses a lone surrogate without naming the field: find it.
        problem = json_body_problem(body)
        if problem is not None:
            raise InvalidInput(problem) from None
        raise
    check_reporting_node(
        principal, report.node.name, allow_shared=services.settings.allow_shared_agent_tokens
    )
    reply = await services.ingest.ingest(report)
    return reply.model_dump_json().encode()


@router.post(
    "/reports",
    operation_id="post_report",
    summary="Store one agent report; the reply carries pending commands",
    response_model=wire.ReportReply,
    responses={**AUTH_ERRORS, **BAD_BODY, **TOO_LARGE, **UNAVAILABLE, **INVALID},
    openapi_extra=REPORT_BODY,
)
async def post_report(
    request: Request,
    principal: Principal = Depends(require_agent),
    services: Services = ServicesDep,
) -> Response:
    payload = await handle_report(services, await request.body(), principal)
    return Response(payload, media_type="application/json")


class ReportFastPath:
    """Serve ``POST /api/v1/reports`` without FastAPI's per-request overhead."""

    def __init__(self, app: ASGIApp, *, controller: Replica, max_bytes: int) -> None:
        self.app = app
        self.services = controller.services
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        try:
            status, payload = 200, await self._serve(scope, receive)
        except ControllerError as exc:
            status, payload, headers = error_payload(exc)
        except Exception:
            log.exception("unhandled error", extra={"fields": {"path": PATH}})
            status = 500
            payload = b'{"detail":"internal error; the controller log has the details"}'
        raw_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await send({"type": "http.response.body", "body": payload})

    async def _serve(self, scope: Scope, receive: Receive) -> bytes:
        authorization: str | None = None
        length: int | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = int(value) if value.isdigit() else None
        principal = self.services.auth.authorize(authorization, REPORT_ROLES, read=False)
        if length is not None and length > self.max_bytes:
            raise payload_too_large(self.max_bytes, reports=True)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise MalformedBody("request body incomplete: the client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise payload_too_large(self.max_bytes, reports=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return await handle_report(self.services, b"".join(chunks), principal)
