"""``GET /api/v1/status``: a one-screen summary of the cluster."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from controller.api.deps import AUTH_ERRORS, Replica, ReplicaDep, ServicesDep, require_viewer
from controller.auth import Principal
from controller.schemas import StatusPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["status"])


@router.get(
    "/status", operation_id="get_status", response_model=StatusPublic, responses=AUTH_ERRORS
)
async def get_status(
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
    replica: Replica = ReplicaDep,
) -> StatusPublic:
    summary = queries.status(services.state, version=replica.version, database=replica.database)
    return summary.model_copy(update={"leader": replica.acting})
