"""Commands queued for agents and what became of them."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query

from controller.api.deps import AUTH_ERRORS, Page, ServicesDep, require_viewer
from controller.auth import Principal
from controller.schemas import CommandsPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["commands"])

StatusFilter = Literal["pending", "sent", "succeeded", "failed", "relayed", "expired"]


@router.get(
    "/commands",
    operation_id="list_commands",
    response_model=CommandsPublic,
    responses=AUTH_ERRORS,
)
async def list_commands(
    node: str | None = Query(None, max_length=253),
    status: StatusFilter | None = Query(None),
    page: Page = Depends(),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> CommandsPublic:
    data, count = await services.store.read(
        lambda s: queries.list_commands(
            s, node=node, status=status, limit=page.limit, offset=page.offset
        )
    )
    return CommandsPublic(data=data, count=count)
