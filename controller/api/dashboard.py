"""Routes the dashboard needs beyond the rest of the API: who am I, the live stream
(server-sent events), downsampled GPU history, recent step times, checkpoints, power
history and per-link plan load (viewer role, read-only), and acknowledging an incident
(operator role; recorded as an action).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    ServicesDep,
    job_ended,
    presented_authorization,
    require_operator,
    require_viewer,
)
from controller.auth import READ_ROLES, Principal
from controller.errors import Conflict, ControllerError, NotFound
from controller.services import queries
from controller.services.agent_identity import IdentityResolver
from controller.services.container import Services
from controller.services.dashboard import CLOSE, RESYNC
from controller.services.dashboard_reads import job_checkpoints, node_history, plan_links
from controller.services.history_prometheus import PrometheusHistory, PrometheusUnavailable
from trainguard import wire

log = logging.getLogger(__name__)
router = APIRouter(tags=["dashboard"])

#: Seconds between heartbeats on an idle stream (the page calls itself "behind" after 8).
HEARTBEAT_S = 3.0
#: Seconds between checks that a stream's credential still reads: a revoked or expired one
#: gets no update after this long (one sha256 and a dict lookup per stream per second).
RECHECK_S = 1.0
MAX_WINDOW_S = 24 * 3600.0


@router.post(
    "/incidents/{id}/ack",
    operation_id="ack_incident",
    tags=["incidents"],
    responses={**AUTH_ERRORS, **NOT_FOUND, 409: {"description": "Resolved already"}},
)
async def ack_incident(
    id: int = Path(ge=1, le=2**62),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Say that someone is on it. The incident stays open (resolve it when the fault is
    fixed); the acknowledgement is an action row (``ack_incident``, target
    ``incident:{id}``), so it is audited like every other operator action."""
    incident_id = id
    if services.state.incidents.get(incident_id) is None:
        found = await services.store.read(lambda s: queries.get_incident(s, incident_id))
        if found is None:
            raise NotFound(f"incident {id} not found")
        raise Conflict(f"incident {id} is resolved already; nothing to acknowledge")
    action = await services.actions.create(
        kind="ack_incident",
        target=f"incident:{id}",
        trigger=f"operator:{principal.name}",
        params={"incident": id},
        status="succeeded",
        outcome=f"acknowledged by {principal.name}",
    )
    return {"incident": id, "acknowledged_by": principal.name, "action": action}


@router.get("/whoami", operation_id="whoami", responses=AUTH_ERRORS)
async def whoami(principal: Principal = Depends(require_viewer)) -> dict[str, Any]:
    """The caller's token name and role (``null`` for anonymous read): the page shows
    action buttons only to ``operator`` (the write routes check the role themselves)."""
    return {"name": principal.name, "role": principal.role}


# Not in the OpenAPI schema: an endless text/event-stream is no JSON operation (a client
# generator or a schema fuzzer would wait on it forever). docs/dashboard.md describes it.
@router.get("/stream", include_in_schema=False)
async def stream(
    request: Request,
    principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> StreamingResponse:
    """Server-sent events: ``hello``, then ``nodes`` (a full snapshot, later only changed
    nodes), ``changed`` (topics to fetch again) and ``ping`` every 3 s when idle. Every
    message carries ``t``, the controller's time, so a client sees when it lags; a client
    too slow to take what was sent gets a snapshot with ``missed`` (messages dropped).
    When the controller stops, the stream ends (the page reconnects by itself); so it does
    within ``RECHECK_S`` of its credential being revoked or expiring, or losing the read
    role: the role check at the start is not enough for a response that never ends."""
    feed = services.dashboard
    authorization = presented_authorization(request)
    sub = feed.subscribe()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield f'event: hello\ndata: {{"t":{time.time()}}}\n\n'.encode()
            yield feed.snapshot()
            last_sent = last_check = time.monotonic()
            while True:
                try:
                    message = await asyncio.wait_for(sub.queue.get(), timeout=RECHECK_S)
                except TimeoutError:
                    message = None
                now = time.monotonic()
                if now - last_check >= RECHECK_S:
                    last_check = now
                    if not await _may_still_read(request, services, authorization):
                        log.info(
                            "event stream ended: its credential is no longer valid",
                            extra={"fields": {"principal": principal.name}},
                        )
                        return
                if message is None:
                    if now - last_sent < HEARTBEAT_S:
                        continue
                    if await request.is_disconnected():
                        return
                    message = f'event: ping\ndata: {{"t":{time.time()}}}\n\n'.encode()
                elif message == CLOSE:  # the controller stops: end the response cleanly
                    return
                elif message == RESYNC:
                    message = feed.resync(sub)
                last_sent = now
                yield message
        finally:
            feed.unsubscribe(sub)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _may_still_read(request: Request, services: Services, authorization: str | None) -> bool:
    """Whether the credential a stream was opened with would still be let in to read: the
    door's resolution (configured tokens, per-node tokens, TokenReview answers) and the
    role, as a new request would meet them."""
    if authorization is None:
        return services.auth.allow_anonymous_read
    resolver: IdentityResolver = request.app.state.identity
    try:
        found = await resolver.resolve(authorization)
    except ControllerError:
        return False
    return found.role in READ_ROLES


@router.get(
    "/nodes/{name}/history",
    operation_id="get_node_history",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_node_history(
    name: str = Path(max_length=253),
    window_s: float = Query(3600.0, gt=0, le=MAX_WINDOW_S, description="Seconds back from now"),
    points: int = Query(240, ge=10, le=2000, description="Most buckets per GPU"),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Per-GPU power, temperature, SM clock, utilization, ECC totals and active throttle
    reasons, averaged (maxima for temperature and ECC) into at most ``points`` buckets.

    From Prometheus when ``prometheus_url`` is set (``source: prometheus``); from the
    controller's database otherwise, or when Prometheus does not answer (``source:
    database`` and ``fallback`` saying why), so the chart is never empty for its sake."""
    if name not in services.state.nodes:
        raise NotFound(f"node {name!r} not found; it appears after its first report")
    now = time.time()
    since = now - window_s
    fallback = None
    url = services.settings.prometheus_url
    if url:
        prometheus = PrometheusHistory(url, timeout_s=services.settings.prometheus_timeout_s)
        try:
            return await prometheus.node_history(name, since, now, points)
        except PrometheusUnavailable as exc:
            log.warning("prometheus history unavailable", extra={"fields": {"error": str(exc)}})
            fallback = f"Prometheus unavailable ({exc}); charts from the controller's database"
    found = await services.store.read(lambda s: node_history(s, name, since, now, points))
    return {**found, "source": "database", "fallback": fallback}


@router.get(
    "/jobs/{name}/steps", operation_id="get_job_steps", responses={**AUTH_ERRORS, **NOT_FOUND}
)
async def get_job_steps(
    name: str = Path(max_length=253),
    last: int = Query(120, ge=1, le=1000, description="Most recent steps"),
    after: int | None = Query(
        None,
        ge=-1,
        le=wire.MAX_STEP,
        description="Only steps newer than this one (a delta to merge; -1: all of them)",
    ),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Step time per rank for the job's most recent steps, and its goodput (ETTR) every 5 s
    over the last hour (both kept in memory since the controller started; bounded).

    With ``after``, only the steps newer than it: the job page refreshes a 2,048-rank matrix
    without being sent again the ~2 MB it holds. ``incremental`` false (and ``reason``) says
    the answer is the whole window instead; ``epoch``, ``first_step`` and ``next_after`` say
    how to merge it (docs/dashboard.md "Incremental steps")."""
    feed = services.dashboard
    matrix = feed.steps.matrix(name, last, time.time(), after)
    if matrix is None:
        if name not in services.state.jobs:
            # Step times live in memory only: a job that left it keeps its rows, not these.
            if not await job_ended(services, name):
                raise NotFound(f"job {name!r} not found")
            raise NotFound(
                queries.ENDED.format(name=name)
                + "; its step times were kept in memory only and went with it (its"
                " checkpoints and incidents are stored: /checkpoints, /incidents?job=NAME)"
            )
        raise NotFound(f"job {name!r} has no step times here; they start with its next report")
    return {**matrix, "goodput": feed.goodput_history.series(name)}


@router.get(
    "/jobs/{name}/checkpoints",
    operation_id="list_job_checkpoints",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def list_job_checkpoints(
    name: str = Path(max_length=253),
    limit: int = Query(200, ge=1, le=5000),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Checkpoint events the job's ranks reported, newest first; ``tier`` says which copy
    of the step an event is about (``local`` disk or ``object_store``). A job that left
    memory (``job_retention_s``) keeps its rows: they answer as for a live one; 404 only
    for a job the database never stored."""
    live = name in services.state.jobs

    def read(session: Any) -> list[dict[str, Any]] | None:
        data = job_checkpoints(session, name, limit)
        if data or live or queries.job_stored(session, name):
            return data
        return None

    data = await services.store.read(read)
    if data is None:
        raise NotFound(f"job {name!r} not found")
    return {"data": data, "count": len(data)}


@router.get("/power/history", operation_id="get_power_history", responses=AUTH_ERRORS)
async def get_power_history(
    window_s: float = Query(3600.0, gt=0, le=MAX_WINDOW_S),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Each domain's draw every 5 s (in memory since the controller started; one hour)."""
    return services.dashboard.power_history.series(time.time() - window_s)


@router.get(
    "/plans/{plan_id}/links",
    operation_id="get_plan_links",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_plan_links(
    plan_id: str = Path(max_length=64),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Bytes per link under the plan and under one seeded ECMP draw, busiest first."""
    live = services.traffic.plans.get(plan_id)
    if live is None:
        raise NotFound(f"plan {plan_id!r} not found")
    data = await asyncio.to_thread(plan_links, live.plan)
    return {"data": data, "count": len(data)}
