"""Unauthenticated probes: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.api.deps import Replica, ReplicaDep, ServicesDep
from controller.schemas import HealthzPublic, ReadyzPublic
from controller.services.container import Services

router = APIRouter(tags=["probes"])


@router.get(
    "/healthz",
    operation_id="healthz",
    response_model=HealthzPublic,
    responses={503: {"model": HealthzPublic, "description": "Writer stopped"}},
)
async def healthz(replica: Replica = ReplicaDep) -> Response:
    """Liveness from cached state only: never touches the database."""
    if not replica.alive:
        return JSONResponse({"status": "writer_stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=ReadyzPublic,
    responses={503: {"model": ReadyzPublic, "description": "Not ready"}},
)
async def readyz(replica: Replica = ReplicaDep) -> Response:
    ok, detail = await replica.ready()
    if ok:
        return JSONResponse({"status": "ready", "detail": ""})
    return JSONResponse({"status": "not_ready", "detail": detail}, status_code=503)


@router.get("/metrics", include_in_schema=False)
async def metrics(services: Services = ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
