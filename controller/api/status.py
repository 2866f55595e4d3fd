"""``GET /api/v1/status``: a one-screen summary of the cluster."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from controller.api.deps import AUTH_ERRORS, ControllerDep, require_viewer
from controller.auth import Principal
from controller.runtime import Controller
from controller.schemas import StatusPublic
from controller.services import queries

router = APIRouter(tags=["status"])


@router.get(
    "/status", operation_id="get_status", response_model=StatusPublic, responses=AUTH_ERRORS
)
async def get_status(
    _principal: Principal = Depends(require_viewer), controller: Controller = ControllerDep
) -> StatusPublic:
    summary = queries.status(
        controller.state, version=controller.version, database=controller.database
    )
    return summary.model_copy(update={"leader": controller.acting})
