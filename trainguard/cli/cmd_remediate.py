"""Remediation commands: what the policy did (``remediation``), the policy itself
(``policy``), isolating and releasing nodes by hand, and a job's ``goodput``."""

from __future__ import annotations

import shlex
import time
from typing import Annotated, Any

import typer

from trainguard.cli.options import DEFAULT_OUTPUT, Output, Server, Token, connect
from trainguard.cli.output import (
    Column,
    OutputFormat,
    age_of,
    align,
    cell,
    dump_json,
    dump_yaml,
    emit,
    field,
    note,
    table_of,
)
from trainguard.cli.replies import printable

REMEDIATIONS = (
    Column("ID", field("id")),
    Column("INCIDENT", field("incident")),
    Column("KIND", field("incident_kind")),
    Column("JOB", field("job")),
    Column("NODE", field("node")),
    Column("STATE", field("state")),
    Column("GEN", field("generation")),
    Column("AGE", age_of("started_unix_s")),
    Column("STEPS", field("steps"), wide=True),
    Column("RESUME-STEP", field("resume_step"), wide=True),
    Column("OUTCOME", field("outcome")),
)

RULES = (
    Column("KIND", field("kind")),
    Column("SEVERITY", field("severity")),
    Column("STEPS", field("steps")),
    Column("AFTER-S", field("after_s")),
    Column("MIN-COST-%", field("min_cost_pct")),
    Column("MIN-BAD-STEPS", field("min_bad_steps")),
    Column("ISOLATE", field("isolate_when")),
)

LOSSES = (
    Column("INCIDENT", field("incident_id")),
    Column("KIND", field("kind")),
    Column("DETECT-S", lambda item, _now: _seconds(item.get("detection_s"))),
    Column("RECOVER-S", lambda item, _now: _seconds(item.get("recovery_s"))),
    Column("STEPS-LOST", field("recomputed_steps")),
    Column("LOST-S", lambda item, _now: _seconds(item.get("lost_s"))),
)


def _seconds(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else cell(value)


def _structured(data: Any, fmt: OutputFormat) -> bool:
    if fmt is OutputFormat.JSON:
        emit(dump_json(data))
        return True
    if fmt is OutputFormat.YAML:
        emit(dump_yaml(data))
        return True
    return False


def remediation(
    ctx: typer.Context, server: Server = None, token: Token = None, output: Output = DEFAULT_OUTPUT
) -> None:
    """Show what the remediation policy did (newest first) and which nodes are isolated."""
    with connect(ctx, server, token) as api:
        data = api.remediation()
    if _structured(data, output):
        return
    mode = "dry-run" if data.get("dry_run") else ("on" if data.get("enabled") else "off")
    emit(
        align(
            [
                ("POLICY", mode),
                ("ACTUATOR", cell(data.get("actuator"))),
                ("LEADER", cell(data.get("leader"))),
                ("ISOLATED", cell(data.get("isolated_nodes"))),
            ]
        )
    )
    items = data.get("remediations") or []
    if not items:
        note("No remediations yet.")
        return
    wide = output is OutputFormat.WIDE
    emit("\n" + table_of(items, REMEDIATIONS, wide=wide, now_unix_s=time.time()))


def policy(
    ctx: typer.Context, server: Server = None, token: Token = None, output: Output = DEFAULT_OUTPUT
) -> None:
    """Show the remediation policy in force: its rules (first match wins) and guard rails."""
    with connect(ctx, server, token) as api:
        data = api.remediation().get("policy") or {}
    if _structured(data, output):
        return
    guards = data.get("guards") or {}
    restarts = data.get("restarts") or {}
    emit(table_of(data.get("rules") or [], RULES, wide=True, now_unix_s=time.time()))
    emit("\n" + align([(cell(k).upper(), cell(v)) for k, v in {**guards, **restarts}.items()]))


def isolate(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Node to keep work off.", show_default=False)],
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded and shown).")],
    server: Server = None,
    token: Token = None,
) -> None:
    """Isolate a node by hand (cordon + taint on Kubernetes); needs an operator token."""
    with connect(ctx, server, token) as api:
        result = api.set_isolation(node, isolate=True, reason=reason)
    emit(f"node/{printable(node, None)} isolated: {printable(result['outcome'])}")
    running = [printable(str(j), 253) for j in result.get("running_jobs") or []]
    if running:
        # Isolation keeps new work off; the jobs already there go on until restarted.
        job = running[0] if len(running) == 1 else "JOB"
        emit(
            f"still running there: {', '.join(running)}; isolation does not move them: "
            f"trainguard restart {job} --reason {shlex.quote(reason)}"
        )


def restart(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job to restart.", show_default=False)],
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded and shown).")],
    server: Server = None,
    token: Token = None,
) -> None:
    """Restart a job now, from its newest checkpoint, without isolated nodes (the policy's
    restart step, under its rate limit); needs an operator token."""
    with connect(ctx, server, token) as api:
        result = api.restart_job(job, reason=reason)
    emit(f"job/{printable(job, None)} restarted: {printable(result['outcome'])}")


def approve(
    ctx: typer.Context,
    action: Annotated[
        int, typer.Argument(help="Id of the dry-run action (trainguard remediation).", min=1)
    ],
    server: Server = None,
    token: Token = None,
) -> None:
    """Carry out a dry run the policy only recorded (a restart, an isolation or a job's
    held-back plan), at most once; needs an operator token."""
    with connect(ctx, server, token) as api:
        result = api.approve(action)
    emit(f"action/{action} approved: {printable(result['outcome'])}")


def release(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Isolated node to put back.", show_default=False)],
    reason: Annotated[str | None, typer.Option("--reason", help="Why (recorded).")] = None,
    server: Server = None,
    token: Token = None,
) -> None:
    """Put an isolated node back into service; needs an operator token."""
    with connect(ctx, server, token) as api:
        result = api.set_isolation(node, isolate=False, reason=reason)
    emit(f"node/{printable(node, None)} released: {printable(result['outcome'])}")


def goodput(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job name.", show_default=False)],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Show a job's goodput: productive vs. wall time, and what each incident cost."""
    with connect(ctx, server, token) as api:
        data = api.goodput(job)
    if _structured(data, output):
        return
    ratio = data.get("ettr")
    emit(
        align(
            [
                ("JOB", cell(data.get("job"))),
                ("GOODPUT", f"{ratio:.1%}" if isinstance(ratio, int | float) else cell(ratio)),
                ("WALL-S", _seconds(data.get("wall_s"))),
                ("PRODUCTIVE-S", _seconds(data.get("productive_s"))),
                ("LOST-S", _seconds(data.get("lost_s"))),
                ("LAST-STEP", cell(data.get("high_water_step"))),
            ]
        )
    )
    incidents = data.get("incidents") or []
    if incidents:
        emit("\n" + table_of(incidents, LOSSES, wide=True, now_unix_s=time.time()))


def register(app: typer.Typer) -> None:
    for command in (remediation, policy, goodput, isolate, release, restart, approve):
        app.command(rich_help_panel="Remediate")(command)


__all__ = ["register"]
