"""Refuse API calls on a replica that does not lead, so a standby changes nothing.

A standby has loaded no state and runs no writer: a report it took would wait for a commit
that never comes, and an operator's command would be written beside the leader's state. So
every ``/api/`` call answers 503 with ``Retry-After`` (agents keep the report in their spool
and retry, and the Service sends them to the ready leader), except ``GET /api/v1/status``,
which says ``"leader": false``. Probes and ``/metrics`` pass: ``/readyz`` is how a standby
tells Kubernetes to route elsewhere.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from controller.api.deps import Replica
from trainguard import wire

STATUS_PATH = f"{wire.API_PREFIX}/status"


class StandbyGate:
    """Plain ASGI layer in front of everything (including the report fast path)."""

    def __init__(self, app: ASGIApp, *, controller: Replica) -> None:
        self.app = app
        self.replica = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or self.replica.acting
            or not scope["path"].startswith("/api/")
            or (scope["path"] == STATUS_PATH and scope["method"] == "GET")
        ):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": self.replica.services.leader.detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


__all__ = ["StandbyGate"]
