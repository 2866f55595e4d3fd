"""Incidents, newest first; an operator resolves one when the fault is fixed."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    Page,
    ServicesDep,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.errors import Conflict, NotFound
from controller.schemas import IncidentPublic, IncidentsPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["incidents"])

IncidentId = Path(ge=1, le=2**62)


@router.get(
    "/incidents",
    operation_id="list_incidents",
    response_model=IncidentsPublic,
    responses=AUTH_ERRORS,
)
async def list_incidents(
    state: Literal["open", "resolved"] | None = Query(None),
    kind: str | None = Query(None, max_length=64),
    node: str | None = Query(None, max_length=253),
    job: str | None = Query(None, max_length=253),
    page: Page = Depends(),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> IncidentsPublic:
    data, count = await services.store.read(
        lambda s: queries.list_incidents(
            s, state=state, kind=kind, node=node, job=job, limit=page.limit, offset=page.offset
        )
    )
    return IncidentsPublic(data=data, count=count)


@router.get(
    "/incidents/{id}",
    operation_id="get_incident",
    response_model=IncidentPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_incident(
    id: int = IncidentId,
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> IncidentPublic:
    incident_id = id
    found = await services.store.read(lambda s: queries.get_incident(s, incident_id))
    if found is None:
        raise NotFound(f"incident {id} not found")
    return found


@router.post(
    "/incidents/{id}/resolve",
    operation_id="resolve_incident",
    response_model=IncidentPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND, 409: {"description": "Already resolved"}},
)
async def resolve_incident(
    id: int = IncidentId,
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> IncidentPublic:
    incident_id = id
    incident = services.state.incidents.get(incident_id)
    if incident is None:
        found = await services.store.read(lambda s: queries.get_incident(s, incident_id))
        if found is None:
            raise NotFound(f"incident {id} not found")
        raise Conflict(f"incident {id} is already resolved")
    await services.incidents.resolve(incident, note=f"resolved by {principal.name}")
    found = await services.store.read(lambda s: queries.get_incident(s, incident_id))
    assert found is not None
    return found
