"""Actions the policy took (or would have taken, ``dry_run``), newest first."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from controller.api.deps import AUTH_ERRORS, Page, ServicesDep, require_viewer
from controller.auth import Principal
from controller.schemas import ActionsPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["actions"])


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
