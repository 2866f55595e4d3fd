"""Actions the policy took (or would have taken, ``dry_run``), newest first; an operator
approves a dry run (carrying it out) or restarts a job by hand."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, Field

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    Page,
    ServicesDep,
    job_ended,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.errors import Conflict, NotFound
from controller.schemas import ActionsPublic
from controller.services import queries
from controller.services.container import Services
from controller.services.operator_actions import approvals, restart_job
from trainguard.limits import NO_NUL

router = APIRouter(tags=["actions"])

CONFLICT: dict[int | str, dict[str, Any]] = {409: {"description": "Refused (the detail says why)"}}


@router.get(
    "/actions", operation_id="list_actions", response_model=ActionsPublic, responses=AUTH_ERRORS
)
async def list_actions(
    page: Page = Depends(),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> ActionsPublic:
    data, count = await services.store.read(
        lambda s: queries.list_actions(s, limit=page.limit, offset=page.offset)
    )
    return ActionsPublic(data=data, count=count)


@router.post(
    "/actions/{id}/approve",
    operation_id="approve_action",
    responses={**AUTH_ERRORS, **NOT_FOUND, **CONFLICT},
)
async def approve_action(
    id: int = Path(ge=1, le=2**62),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Carry out an action the policy only recorded (``dry_run``): a ``restart_job``
    restarts its job, an ``isolate_node`` isolates its node. At most once per dry run; the
    approval is an action row (``approve_action``, target ``action:{id}``)."""
    service = approvals(services.store, services.actions, services.remediation)
    return await service.approve(id, principal.name)


class RestartRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=500, pattern=NO_NUL)


@router.post(
    "/jobs/{name}/restart",
    operation_id="restart_job",
    tags=["remediation"],
    responses={**AUTH_ERRORS, **NOT_FOUND, **CONFLICT},
)
async def restart_job_route(
    name: str = Path(max_length=253),
    body: RestartRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Stop the job and start it again through the actuator, from its newest committed
    checkpoint, without isolated nodes (the policy's ``restart`` step, under its rate
    limit). 409 when no actuator is configured, a remediation of the job is in progress,
    or the restart is refused or fails."""
    if name not in services.state.jobs and name not in services.remediation.jobs:
        if await job_ended(services, name):
            raise Conflict(queries.ENDED.format(name=name) + ": nothing runs to restart")
        raise NotFound(f"job {name!r} not found")
    engine, actions = services.remediation, services.actions
    return await restart_job(engine, actions, name, principal.name, body.reason)
