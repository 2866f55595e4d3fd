"""Read commands: ``status``, ``nodes``, ``node``, ``jobs``, ``job``, ``incidents``,
``actions``.

Each one is: parse flags, one :class:`~trainguard.cli.client.ApiClient` call, render
through :mod:`trainguard.cli.views`. No business logic lives here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from trainguard.cli.options import DEFAULT_OUTPUT, Output, Server, Token, connect
from trainguard.cli.output import OutputFormat, emit, note, refuse_format
from trainguard.cli.views import (
    ACTIONS,
    INCIDENTS,
    JOBS,
    JOBS_HISTORY,
    NODES,
    ResourceView,
    render_job,
    render_list,
    render_node,
    render_status,
)


class Health(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    LOST = "lost"
    UNKNOWN = "unknown"


class IncidentState(StrEnum):
    OPEN = "open"
    RESOLVED = "resolved"
    ALL = "all"


def _show(view: ResourceView, items: list[dict[str, object]], fmt: OutputFormat) -> None:
    text = render_list(view, items, fmt)
    if text is None:
        note(f"No {view.plural} found.")
    else:
        emit(text)


def status(
    ctx: typer.Context, server: Server = None, token: Token = None, output: Output = DEFAULT_OUTPUT
) -> None:
    """Show the controller's summary: nodes by health, GPUs, incidents, reports."""
    if output is OutputFormat.NAME:
        raise refuse_format(output, "status")
    with connect(ctx, server, token) as api:
        emit(render_status(api.status(), api.server, output))


def nodes(
    ctx: typer.Context,
    health: Annotated[
        Health | None, typer.Option("--health", help="Only nodes in this health state.")
    ] = None,
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """List nodes with their health, GPUs and open incidents."""
    with connect(ctx, server, token) as api:
        items = api.nodes(health.value if health else None)
    _show(NODES, items, output)


def node(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Node name.", show_default=False)],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Show one node: its health, every GPU's latest sample and reasons."""
    with connect(ctx, server, token) as api:
        emit(render_node(api.node(name), output))


def jobs(
    ctx: typer.Context,
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            help="Every job the controller's database holds, ended ones too (STATE ended, "
            "SOURCE history: they left its memory after job_retention_s).",
        ),
    ] = False,
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """List training jobs seen by the agents (those in the controller's memory)."""
    with connect(ctx, server, token) as api:
        items = api.jobs(history=history)
    _show(JOBS_HISTORY if history else JOBS, items, output)


def job(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Job name.", show_default=False)],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Show one job and its ranks; an ended one as the controller's database stored it."""
    with connect(ctx, server, token) as api:
        emit(render_job(api.job(name), output))


def incidents(
    ctx: typer.Context,
    state: Annotated[
        IncidentState, typer.Option("--state", help="Which incidents to list.")
    ] = IncidentState.OPEN,
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only this kind, e.g. gpu_fault, node_lost.")
    ] = None,
    node_name: Annotated[str | None, typer.Option("--node", help="Only this node.")] = None,
    job: Annotated[str | None, typer.Option("--job", help="Only this job.")] = None,
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """List incidents, newest first (open ones unless --state says otherwise)."""
    with connect(ctx, server, token) as api:
        items = api.incidents(
            state=None if state is IncidentState.ALL else state.value,
            kind=kind,
            node=node_name,
            job=job,
        )
    _show(INCIDENTS, items, output)


def actions(
    ctx: typer.Context, server: Server = None, token: Token = None, output: Output = DEFAULT_OUTPUT
) -> None:
    """List actions the controller took or proposed, newest first."""
    with connect(ctx, server, token) as api:
        items = api.actions()
    _show(ACTIONS, items, output)


def register(app: typer.Typer) -> None:
    for command in (status, nodes, node, jobs, job, incidents, actions):
        app.command(rich_help_panel="Inspect")(command)


__all__ = ["register"]
