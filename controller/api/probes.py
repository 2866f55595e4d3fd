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
    """Ready: the replica's own checks pass and its writes are not stuck on the database.

    A hung server (a COMMIT waiting for a lost synchronous replica, a lock held elsewhere)
    still answers the readiness query on another connection, so the write in flight is
    checked too: while one has run past ``database_write_stalled_after_s`` every report
    behind it waits, and the replica says so (until the statement timeout ends it).
    """
    ok, detail = await replica.ready()
    if ok:
        services = replica.services
        stalled_s = services.store.write_in_flight_s
        if stalled_s > services.settings.database_write_stalled_after_s:
            detail = (
                f"database write stalled: one has been in flight for {stalled_s:.0f} s "
                "(server hung or a lock held elsewhere); reports wait"
            )
            ok = False
    if ok:
        return JSONResponse({"status": "ready", "detail": ""})
    return JSONResponse({"status": "not_ready", "detail": detail}, status_code=503)


@router.get("/metrics", include_in_schema=False)
async def metrics(services: Services = ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
