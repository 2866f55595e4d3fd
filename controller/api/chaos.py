"""Chaos drills on a running job (operators only)."""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, Field

from controller.api.deps import AUTH_ERRORS, NOT_FOUND, ServicesDep, require_operator
from controller.auth import Principal
from controller.schemas import CommandsPublic
from controller.services import chaos, queries
from controller.services.container import Services
from trainguard import wire
from trainguard.limits import NO_NUL

router = APIRouter(tags=["jobs"])


class FaultsRequest(BaseModel):
    faults: list[wire.FaultSpec] = Field(min_length=1, max_length=64)
    reason: str = Field(default="", max_length=512, pattern=NO_NUL)


@router.post(
    "/jobs/{name}/faults",
    operation_id="inject_job_faults",
    status_code=201,
    response_model=CommandsPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def inject_job_faults(
    name: str = Path(max_length=253),
    body: FaultsRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> CommandsPublic:
    created = await chaos.inject_faults(
        services.state,
        services.commands,
        name,
        body.faults,
        reason=body.reason,
        by=principal.name,
    )
    data = [queries.command_public(c) for c in created]
    return CommandsPublic(data=data, count=len(data))
