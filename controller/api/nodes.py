"""Nodes, their GPUs and history, and the commands queued for them."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Body, Depends, Path, Query

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    Page,
    ServicesDep,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.errors import NotFound
from controller.schemas import CommandPublic, CommandRequest, NodeDetail, NodesPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["nodes"])

NodeName = Path(description="Node name", max_length=253)
MAX_HISTORY_S = 30 * 24 * 3600.0


@router.get("/nodes", operation_id="list_nodes", response_model=NodesPublic, responses=AUTH_ERRORS)
async def list_nodes(
    health: Literal["healthy", "unhealthy", "lost", "unknown"] | None = Query(None),
    page: Page = Depends(),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> NodesPublic:
    nodes = queries.list_nodes(services.state, health)
    return NodesPublic(data=nodes[page.offset : page.offset + page.limit], count=len(nodes))


@router.get(
    "/nodes/{name}",
    operation_id="get_node",
    response_model=NodeDetail,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_node(
    name: str = NodeName,
    history_s: float = Query(600.0, ge=0, le=MAX_HISTORY_S, description="History window (s)"),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> NodeDetail:
    node = services.state.nodes.get(name)
    if node is None:
        raise NotFound(f"node {name!r} not found")
    since = time.time() - history_s
    history = await services.store.read(lambda s: queries.gpu_history(s, name, since))
    return queries.node_detail(services.state, node, history)


@router.post(
    "/nodes/{name}/commands",
    operation_id="create_command",
    status_code=201,
    response_model=CommandPublic,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def create_command(
    name: str = NodeName,
    command: CommandRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> CommandPublic:
    created = await services.commands.create(name, command, by=principal.name)
    return queries.command_public(created)
