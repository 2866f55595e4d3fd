"""Preflight: ask a node's agent to run its hardware checks, and read the verdict.

The request travels the existing command channel (``wire.RunPreflight`` in the next
``ReportReply``); the agent's ack is the verdict: ``succeeded`` when every check passed,
``failed`` with the failing checks named in ``reason``, ``expired`` when the agent never
answered. The Kubernetes actuator or a scheduler hook can call the same two routes.
"""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    ServicesDep,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.errors import NotFound
from controller.schemas import CommandPublic
from controller.services import queries
from controller.services.container import Services
from trainguard import wire

router = APIRouter(tags=["preflight"])

NodeName = Path(description="Node name", max_length=253)


class PreflightRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expected_nic_rate_gbps: float | None = Field(
        default=None, gt=0, le=10_000, description="RDMA ports slower than this fail"
    )


@router.post(
    "/nodes/{name}/preflight",
    operation_id="start_preflight",
    status_code=201,
    response_model=CommandPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def start_preflight(
    name: str = NodeName,
    request: PreflightRequest | None = Body(None),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> CommandPublic:
    expected = request.expected_nic_rate_gbps if request is not None else None
    command = wire.RunPreflight(id="new", expected_nic_rate_gbps=expected)
    created = await services.commands.create(name, command, by=principal.name)
    return queries.command_public(created)


@router.get(
    "/nodes/{name}/preflight/{command_id}",
    operation_id="get_preflight",
    response_model=CommandPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_preflight(
    name: str = NodeName,
    command_id: str = Path(max_length=64),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> CommandPublic:
    command = services.state.commands.get(command_id)
    if command is None or command.node != name or command.kind != "run_preflight":
        raise NotFound(f"no recent preflight {command_id!r} on node {name!r}")
    return queries.command_public(command)
