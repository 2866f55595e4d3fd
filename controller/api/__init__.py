"""HTTP routers: parse, authorize, call a service, shape the reply. No SQL here."""

from __future__ import annotations

from fastapi import APIRouter

from controller.api import (
    actions,
    agent_credentials,
    chaos,
    commands,
    dashboard,
    incidents,
    jobs,
    nodes,
    preflight,
    probes,
    remediation,
    reports,
    status,
)
from controller.api import power as power_api
from controller.api import traffic as traffic_api
from trainguard.wire import API_PREFIX


def api_router() -> APIRouter:
    router = APIRouter()
    for module in (reports, status, nodes, jobs, chaos, incidents, actions, commands, remediation):
        router.include_router(module.router, prefix=API_PREFIX)
    router.include_router(preflight.router, prefix=API_PREFIX)
    router.include_router(agent_credentials.router, prefix=API_PREFIX)
    router.include_router(power_api.router, prefix=API_PREFIX)
    router.include_router(traffic_api.router, prefix=API_PREFIX)
    router.include_router(dashboard.router, prefix=API_PREFIX)
    router.include_router(probes.router)
    return router
