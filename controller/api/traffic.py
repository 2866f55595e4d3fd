"""Fabric topology, link health and traffic plans (``controller.services.traffic.service``).

Link names contain ``/`` and ``>`` (``node-1/nic0/p0->tor-a``), so the link is a path
parameter that may span segments; ``a--b`` names both directions of a cable.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, ConfigDict, Field, model_validator

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
from controller.services.traffic import views
from controller.services.traffic.placement import Layout
from trainguard.limits import INT64_MAX, NO_NUL

router = APIRouter(tags=["traffic"])

CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorPublic, "description": "No fabric loaded, or conflicts with it or a plan"}
}


MIN_CAPACITY_FACTOR = 0.001
"""Least share of capacity a slow link may keep. Below a thousandth the link carries nothing
useful (say ``down``), and a denormal like ``1e-320`` turns the planner's capacities into 0 and
its load ratios into ``inf``."""


class LinkStateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["up", "down", "slow"]
    capacity_factor: float | None = Field(
        default=None,
        ge=MIN_CAPACITY_FACTOR,
        lt=1.0,
        allow_inf_nan=False,
        description="Share of capacity left, 0.001 to <1; required for slow",
    )

    @model_validator(mode="after")
    def _factor_for_slow(self) -> Self:
        if self.state == "slow" and self.capacity_factor is None:
            raise ValueError("capacity_factor is required when state is slow")
        if self.state != "slow" and self.capacity_factor is not None:
            raise ValueError(f"capacity_factor applies only to state slow, not {self.state}")
        return self

    def factor(self) -> float:
        if self.state == "slow":
            assert self.capacity_factor is not None
            return self.capacity_factor
        return 1.0 if self.state == "up" else 0.0


class LayoutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(default=1, ge=1, le=1024)
    pp: int = Field(default=1, ge=1, le=1024)
    grad_bytes: int = Field(
        default=1 << 30, ge=0, le=INT64_MAX, description="All-reduce bytes per rank"
    )
    pp_bytes: int = Field(default=0, ge=0, le=INT64_MAX)
    tp_bytes: int = Field(default=0, ge=0, le=INT64_MAX)
    channels: int = Field(default=2, ge=1, le=64)
    qps_per_connection: int = Field(default=1, ge=1, le=16)


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job: str = Field(min_length=1, max_length=253, pattern=NO_NUL)
    layout: LayoutIn = Field(default_factory=LayoutIn)
    replace: bool = Field(default=False, description="Plan again as a new version")


@router.get("/topology", operation_id="get_topology", responses={**AUTH_ERRORS, **CONFLICT})
async def get_topology(
    _principal: Principal = Depends(require_viewer), services: Services = ServicesDep
) -> dict[str, Any]:
    await services.traffic.refresh_fabric()  # label mode: nodes may have (re)labelled
    return views.topology_summary(services.traffic)


@router.post(
    "/topology/links/{link:path}/state",
    operation_id="set_link_state",
    responses={**AUTH_ERRORS, **NOT_FOUND, **CONFLICT},
)
async def set_link_state(
    link: str = Path(max_length=512),
    body: LinkStateRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    return await services.traffic.set_links(
        [(link, body.factor())], reason=f"link {body.state} by {principal.name}"
    )


@router.post(
    "/plans",
    operation_id="create_plan",
    status_code=201,
    responses={**AUTH_ERRORS, **NOT_FOUND, **CONFLICT},
)
async def create_plan(
    body: PlanRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    layout = Layout(**body.layout.model_dump())
    plan_id = await services.traffic.create_plan(
        body.job, layout, replace=body.replace, by=principal.name
    )
    return views.plan_detail(services.traffic, plan_id)


@router.get("/plans", operation_id="list_plans", responses=AUTH_ERRORS)
async def list_plans(
    _principal: Principal = Depends(require_viewer), services: Services = ServicesDep
) -> dict[str, Any]:
    data = views.list_plans(services.traffic)
    return {"data": data, "count": len(data)}


@router.get("/plans/{plan_id}", operation_id="get_plan", responses={**AUTH_ERRORS, **NOT_FOUND})
async def get_plan(
    plan_id: str = Path(max_length=64),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    return views.plan_detail(services.traffic, plan_id)
