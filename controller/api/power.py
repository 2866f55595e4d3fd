"""Power domains: the tree with each domain's power and level; replace it; node and job
priorities (which only steer power capping)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Path

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    ServicesDep,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.schemas import ErrorPublic
from controller.services.container import Services
from controller.services.power.schemas import (
    JobPriorityBody,
    JobPriorityPublic,
    PowerDomainsPublic,
    PriorityBody,
    PriorityPublic,
)

router = APIRouter(tags=["power"])

_INVALID: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorPublic, "description": "Invalid tree; the message names the path"}
}


@router.get(
    "/power/domains",
    operation_id="get_power_domains",
    response_model=PowerDomainsPublic,
    responses=AUTH_ERRORS,
)
async def get_power_domains(
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> PowerDomainsPublic:
    return services.power.view()


@router.put(
    "/power/domains",
    operation_id="put_power_domains",
    response_model=PowerDomainsPublic,
    responses={**AUTH_ERRORS, **_INVALID},
)
async def put_power_domains(
    tree: dict[str, Any] = Body(description="Domain tree: name, kind, budget_w, children"),
    _principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> PowerDomainsPublic:
    return await services.power.replace_tree(tree)


@router.put(
    "/nodes/{name}/priority",
    operation_id="put_node_priority",
    response_model=PriorityPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def put_node_priority(
    body: PriorityBody,
    name: str = Path(max_length=253),
    _principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> PriorityPublic:
    return await services.power.set_priority(name, body.priority)


@router.put(
    "/jobs/{name}/priority",
    operation_id="put_job_priority",
    response_model=JobPriorityPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def put_job_priority(
    body: JobPriorityBody,
    name: str = Path(max_length=253),
    _principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> JobPriorityPublic:
    return await services.power.set_job_priority(name, body.priority)
