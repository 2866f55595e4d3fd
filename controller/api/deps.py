"""Dependencies shared by routers: the services they use, the replica, role checks.

Routers never import ``controller.runtime``: they declare ``services: Services =
ServicesDep`` (or ``replica: Replica = ReplicaDep`` for leadership and readiness).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import Depends, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from controller.auth import READ_ROLES, REPORT_ROLES, WRITE_ROLES, Principal
from controller.schemas import ErrorPublic
from controller.services import queries
from controller.services.container import Services
from controller.settings import Role

_bearer = HTTPBearer(auto_error=False, description="Token with role agent, viewer or operator")
#: The token of a call made through the Kubernetes API server's service proxy (``kubectl
#: trainguard``): the API server removes the ``Authorization`` header it authenticated the
#: user with, so the CLI sends the controller's token here. Used only without Authorization.
PROXIED_TOKEN_HEADER = "x-trainguard-token"

MAX_PAGE = 5000


class Replica(Protocol):
    """What routes may ask of the running replica (``controller.runtime.Controller``)
    beyond its services: whether it leads, lives and is ready, and what it runs."""

    @property
    def version(self) -> str: ...

    @property
    def database(self) -> str: ...

    @property
    def services(self) -> Services: ...

    @property
    def acting(self) -> bool: ...

    @property
    def alive(self) -> bool: ...

    async def ready(self) -> tuple[bool, str]: ...


def get_replica(request: Request) -> Replica:
    replica: Replica = request.app.state.controller
    return replica


def get_services(request: Request) -> Services:
    """Every service, as the composition root built them; a route uses the ones it needs."""
    return get_replica(request).services


async def job_ended(services: Services, name: str) -> bool:
    """Job ``name`` is not in memory but stored: it left after ``job_retention_s``, and the
    routes that only memory answers say it ended rather than "not found"."""
    if name in services.state.jobs:
        return False
    return await services.store.read(lambda s: queries.job_stored(s, name))


def presented_authorization(request: Request) -> str | None:
    """The ``Authorization`` value the request authenticates with: the header, or the
    proxied token header when there is none (``None``: no credential at all)."""
    authorization = request.headers.get("authorization")
    proxied = request.headers.get(PROXIED_TOKEN_HEADER)
    if not authorization and proxied:
        authorization = f"Bearer {proxied}"
    return authorization


def _require(allowed: frozenset[Role], *, read: bool) -> Callable[..., Awaitable[Principal]]:
    async def dependency(
        request: Request,
        _credentials: HTTPAuthorizationCredentials | None = Security(_bearer),
    ) -> Principal:
        authorization = presented_authorization(request)
        return get_services(request).auth.authorize(authorization, allowed, read=read)

    return dependency


require_viewer = _require(READ_ROLES, read=True)
require_operator = _require(WRITE_ROLES, read=False)
require_agent = _require(REPORT_ROLES, read=False)

ServicesDep = Depends(get_services)
ReplicaDep = Depends(get_replica)
#: The replica itself, for routes not yet moved to ``ServicesDep`` (typed as ``Replica``).
ControllerDep = ReplicaDep


class Page:
    """``?limit=&offset=`` of list endpoints."""

    def __init__(
        self,
        limit: int = Query(500, ge=1, le=MAX_PAGE, description="Most items to return"),
        offset: int = Query(0, ge=0, le=10**9, description="Items to skip"),
    ) -> None:
        self.limit = limit
        self.offset = offset


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorPublic, "description": description}


AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _error("Missing or unknown bearer token"),
    403: _error("Token role not allowed here"),
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: _error("No such object")}
UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: _error("Database unavailable; retry")}
TOO_LARGE: dict[int | str, dict[str, Any]] = {413: _error("Body too large")}
BAD_BODY: dict[int | str, dict[str, Any]] = {400: _error("Body is not JSON")}
