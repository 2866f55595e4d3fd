"""``trainguard plan list`` / ``plan get ID``: the controller's plans, read through its API.

The file-based commands next door (``simulate``, ``create``, ``show``) need no controller;
these follow the rest of the CLI instead: ``--server``/``--token``, kubectl-style tables,
``-o json|yaml|name|wide``, and the CLI's own errors and exit codes. Only the CLI's client
is imported, never the controller's server modules.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from trainguard.cli.options import DEFAULT_OUTPUT, Output, Server, Token, connect
from trainguard.cli.output import (
    Column,
    OutputFormat,
    age_of,
    cell,
    dump_json,
    dump_yaml,
    emit,
    field,
    note,
    render_table,
)
from trainguard.cli.views import ResourceView, render_list

JsonObject = dict[str, Any]


def _ms(key: str) -> Any:
    def get(item: JsonObject, _now: float) -> str:
        value = item.get(key)
        return "-" if value is None else f"{float(value) * 1e3:.3f}"

    return get


PLANS = ResourceView(
    kind="plan",
    plural="plans",
    key="plan_id",
    columns=(
        Column("ID", field("plan_id")),
        Column("JOB", field("job")),
        Column("VERSION", field("version")),
        Column("NODES", field("nodes")),
        Column("FLOWS", field("flows")),
        Column("MAX-LINK-MS", _ms("max_link_time_s")),
        Column("AGE", age_of("created_unix_s")),
        Column("BUSIEST-LINK", field("busiest_link"), wide=True),
        Column("MOVED", field("moved_flows"), wide=True),
        Column("OPTIMAL", lambda p, _now: "proven" if p.get("proven_optimal") else "-", wide=True),
    ),
)


def _change(change: JsonObject) -> str:
    return f"{cell(change.get('link'))}={cell(change.get('health'))}"


def render_plan(plan: JsonObject, fmt: OutputFormat) -> str:
    """Describe-style header, then the launcher order, NCCL settings and version history."""
    if fmt is OutputFormat.JSON:
        return dump_json(plan)
    if fmt is OutputFormat.YAML:
        return dump_yaml(plan)
    if fmt is OutputFormat.NAME:
        return PLANS.name_of(plan)
    stats = plan.get("stats") or {}
    layout = plan.get("layout") or {}
    pairs = [
        ("ID", cell(plan.get("plan_id"))),
        ("Job", cell(plan.get("job"))),
        ("Version", cell(plan.get("version"))),
        ("Layout", " ".join(f"{cell(k)}={cell(v)}" for k, v in layout.items())),
        ("Flows", f"{cell(stats.get('flows'))} ({cell(stats.get('flows_via_spine'))} via spine)"),
        ("Max link time", f"{float(stats.get('max_link_time_s') or 0) * 1e3:.3f} ms"),
        ("Optimal", "proven by the exact search" if plan.get("proven_optimal") else "not proven"),
        ("Busiest link", cell(stats.get("busiest_link"))),
        ("Bond imbalance", f"{float(stats.get('bond_imbalance') or 0):.3f}"),
        (
            "NCCL env",
            " ".join(f"{cell(k)}={cell(v)}" for k, v in (plan.get("nccl_env") or {}).items()),
        ),
    ]
    width = max(len(label) for label, _ in pairs) + 2
    head = "\n".join(f"{(label + ':').ljust(width)}{value}" for label, value in pairs)
    order = render_table(
        ["NODE-RANK", "NODE", "FIRST-RANK"],
        [
            [cell(o.get("node_rank")), cell(o.get("node")), cell(o.get("first_rank"))]
            for o in plan.get("launcher_order") or []
        ],
    )
    versions = render_table(
        ["VERSION", "TRIGGER", "MOVED", "REPLAN-MS", "CHANGES"],
        [
            [
                cell(v.get("version")),
                cell(v.get("trigger")),
                cell(v.get("moved_flows")),
                "-" if v.get("replan_ms") is None else f"{float(v['replan_ms']):.1f}",
                ", ".join(_change(c) for c in v.get("changes") or []) or "-",
            ]
            for v in plan.get("versions") or []
        ],
    )
    parts = [head, "Launcher order:\n" + order, "Versions:\n" + versions]
    if fmt is OutputFormat.WIDE:
        nodes = (plan.get("source_ports") or {}).get("nodes") or {}
        rows = [
            [cell(node), cell(q.get("nic")), cell(q.get("peer")), cell(q.get("channel")),
             cell(q.get("qp")), cell(q.get("bond_port")), cell(q.get("udp_sport")),
             " ".join(cell(hop) for hop in q.get("path") or [])]
            for node, qps in sorted(nodes.items())
            for q in qps
        ]  # fmt: skip
        headers = ["NODE", "NIC", "PEER", "CHANNEL", "QP", "BOND-PORT", "UDP-SPORT", "PATH"]
        parts.append("Source ports:\n" + render_table(headers, rows))
    return "\n\n".join(parts)


def plan_list(
    ctx: typer.Context, server: Server = None, token: Token = None, output: Output = DEFAULT_OUTPUT
) -> None:
    """List the controller's traffic plans (newest version of each)."""
    with connect(ctx, server, token) as api:
        items = api.plans()
    text = render_list(PLANS, items, output, now_unix_s=time.time())
    if text is None:
        note("No plans found.")
    else:
        emit(text)


def plan_get(
    ctx: typer.Context,
    plan_id: Annotated[str, typer.Argument(help="Plan id.", show_default=False)],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Show one plan: launcher order, NCCL settings, versions (-o wide: source ports)."""
    with connect(ctx, server, token) as api:
        emit(render_plan(api.plan(plan_id), output))


def register(app: typer.Typer) -> None:
    app.command("list")(plan_list)
    app.command("get")(plan_get)


__all__ = ["PLANS", "register", "render_plan"]
