"""``trainguard preflight``: a node's hardware checks, on this machine or through the controller.

``--local`` runs the agent's check runner here (NVML through the same sampler, RDMA ports from
sysfs, ``clocks_load`` with ``--load-s`` seconds of GPU load) and prints one row per check.
``trainguard preflight NODE...`` asks each node's agent
through the controller (``POST /nodes/{name}/preflight``, the command channel) and waits
for the verdicts. Exit status 0 when everything passed, 1 when a check failed or an agent
did not answer in time, 2 for usage errors.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from trainguard.cli.client import node_name
from trainguard.cli.errors import BadInput
from trainguard.cli.options import DEFAULT_OUTPUT, Output, Server, Token, connect
from trainguard.cli.output import (
    Column,
    OutputFormat,
    dump_json,
    dump_yaml,
    emit,
    field,
    table_of,
)

LOCAL_COLUMNS = (
    Column("NODE", field("node")),
    Column("CHECK", field("name")),
    Column("TARGET", field("target")),
    Column("RESULT", field("status")),
    Column("REASON", field("reason")),
)
REMOTE_COLUMNS = (
    Column("NODE", field("node")),
    Column("RESULT", field("result")),
    Column("COMMAND", field("command"), wide=True),
    Column("REASON", field("reason")),
)
_VERDICT = {"succeeded": "pass", "failed": "fail", "expired": "no-answer"}


def _print(items: list[dict[str, Any]], columns: tuple[Column, ...], fmt: OutputFormat) -> None:
    if fmt is OutputFormat.JSON:
        emit(dump_json(items))
    elif fmt is OutputFormat.YAML:
        emit(dump_yaml(items))
    elif fmt is OutputFormat.NAME:
        emit("\n".join(sorted({f"node/{i['node']}" for i in items})))
    else:
        emit(table_of(items, columns, wide=fmt is OutputFormat.WIDE, now_unix_s=time.time()))


def _local(
    gpus: str,
    dev_dir: Path | None,
    sysfs_root: Path | None,
    timeout_s: float,
    rate: float | None,
    load_s: float,
) -> list[dict[str, Any]]:
    from agents.clocks_load import run_preflight_with_load
    from agents.errors import AgentError
    from agents.gpu.backend import DEFAULT_DEV_DIR, open_backend
    from agents.nics import NicMonitor
    from agents.sampler import GpuSampler
    from agents.settings import default_node_name

    try:
        backend = open_backend(gpus, dev_dir=dev_dir or DEFAULT_DEV_DIR)
    except AgentError as exc:
        raise BadInput(str(exc)) from exc
    sampler = GpuSampler(backend.api, timeout_s=timeout_s)
    try:
        sampler.open()
        checks = run_preflight_with_load(
            backend,
            sampler,
            NicMonitor(sysfs_root or Path("/sys")),
            load_s=load_s,
            expected_nic_rate_gbps=rate,
        )
    finally:
        sampler.close()
        backend.shutdown()
    node = default_node_name()
    return [{"node": node, **c.as_dict()} for c in checks]


def _remote(
    ctx: typer.Context,
    server: str | None,
    token: str | None,
    nodes: list[str],
    rate: float | None,
    wait_s: float,
) -> list[dict[str, Any]]:
    for node in nodes:  # every name checked before the first preflight starts
        node_name(node)
    with connect(ctx, server, token) as api:
        started = {node: api.start_preflight(node, rate) for node in nodes}
        deadline = time.monotonic() + wait_s
        done: dict[str, dict[str, Any]] = {}
        while True:
            for node, command in started.items():
                if node in done:
                    continue
                current = api.preflight(node, command["id"])
                if current["status"] in _VERDICT:
                    done[node] = current
            if len(done) == len(started) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    rows = []
    for node, command in started.items():
        final = done.get(node)
        if final is None:
            rows.append(
                {
                    "node": node,
                    "result": "no-answer",
                    "command": command["id"],
                    "reason": f"the agent did not answer within {wait_s:g} s",
                }
            )
        else:
            rows.append(
                {
                    "node": node,
                    "result": _VERDICT[final["status"]],
                    "command": final["id"],
                    "reason": final["reason"],
                }
            )
    return rows


def preflight(
    ctx: typer.Context,
    nodes: Annotated[
        list[str] | None, typer.Argument(help="Nodes to check (via the controller).")
    ] = None,
    local: Annotated[
        bool, typer.Option("--local", help="Check this machine instead, without a controller.")
    ] = False,
    expected_nic_rate_gbps: Annotated[
        float | None,
        typer.Option(
            "--expected-nic-rate-gbps",
            min=0.001,
            help="RDMA ports slower than this fail (default: the node's fastest port).",
        ),
    ] = None,
    wait: Annotated[
        float, typer.Option("--wait", min=1, help="Seconds to wait for the agents' verdicts.")
    ] = 60.0,
    gpus: Annotated[str, typer.Option("--gpus", help="With --local: auto, nvml or sim:N.")] = (
        "auto"
    ),
    dev_dir: Annotated[
        Path | None, typer.Option("--dev-dir", help="With --local: NVIDIA device files' folder.")
    ] = None,
    sysfs_root: Annotated[
        Path | None, typer.Option("--sysfs-root", help="With --local: root of sysfs.")
    ] = None,
    nvml_timeout: Annotated[
        float, typer.Option("--nvml-timeout", min=0.01, help="With --local: NVML wait, seconds.")
    ] = 2.0,
    load_s: Annotated[
        float,
        typer.Option(
            "--load-s",
            min=0,
            max=600,
            help="With --local: seconds of GPU load for clocks_load (0: skip that check).",
        ),
    ] = 10.0,
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Run the hardware checks of nodes (or of this machine with --local): pass/fail + why."""
    if local and nodes:
        raise BadInput("give NODE names or --local, not both")
    if not local and not nodes:
        raise BadInput("name at least one NODE, or use --local to check this machine")
    if local:
        items = _local(gpus, dev_dir, sysfs_root, nvml_timeout, expected_nic_rate_gbps, load_s)
        _print(items, LOCAL_COLUMNS, output)
        failed = any(i["status"] == "fail" for i in items)
    else:
        rows = _remote(ctx, server, token, list(nodes or []), expected_nic_rate_gbps, wait)
        _print(rows, REMOTE_COLUMNS, output)
        failed = any(r["result"] != "pass" for r in rows)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel="Inspect")(preflight)


__all__ = ["register"]
