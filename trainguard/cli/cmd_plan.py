"""``trainguard plan …``: simulate, create and show traffic plans from the command line.

Imports only typer at module level so mounting this sub-app costs the main CLI nothing;
numpy, networkx and the planner load when a command runs. Every input problem (bad file,
unknown node, impossible layout) ends as one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from trainguard.textfile import Unreadable, read_text

if TYPE_CHECKING:
    from controller.logic.traffic.compare import Variant
    from controller.logic.traffic.jobs import JobSpec
    from controller.logic.traffic.topology import Topology

app = typer.Typer(
    name="plan",
    help="Plan collective traffic paths (C4P-style) and compare them with ECMP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_USAGE = 2


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


class Placement(StrEnum):
    LISTED = "listed"
    SHUFFLED = "shuffled"


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise typer.Exit(EXIT_USAGE)


def _job(
    topo: Topology,
    job_file: Path | None,
    gpus: int | None,
    placement: Placement,
    seed: int,
    tp: int,
    pp: int,
    size_mib: float,
    channels: int,
    qps: int,
) -> JobSpec:
    import random

    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from controller.logic.traffic.errors import JobSpecError
    from controller.logic.traffic.jobs import JobSpec
    from controller.logic.traffic.topofile import parse_document

    class JobIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = "job"
        nodes: list[str] | None = None
        gpus: int | None = Field(None, ge=1)
        gpus_per_node: int = Field(8, ge=1)
        tp: int = Field(8, ge=1)
        pp: int = Field(1, ge=1)
        grad_bytes: int = Field(1 << 30, ge=0)
        pp_bytes: int = Field(0, ge=0)
        tp_bytes: int = Field(0, ge=0)
        channels: int = Field(2, ge=1, le=64)
        qps_per_connection: int = Field(1, ge=1, le=16)

    if job_file is not None:
        try:
            raw = parse_document(read_text(job_file), suffix=job_file.suffix)
        except Unreadable as exc:
            raise JobSpecError(f"{job_file}: {exc.reason}") from None
        try:
            doc = JobIn.model_validate(raw if raw is not None else {})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "job"
            raise JobSpecError(f"{job_file}: {loc}: {err['msg']}") from None
    else:
        doc = JobIn(
            gpus=gpus,
            tp=tp,
            pp=pp,
            grad_bytes=int(size_mib * (1 << 20)),
            channels=channels,
            qps_per_connection=qps,
        )
    names = doc.nodes or [n.name for n in topo.nodes]
    if doc.nodes is None and doc.gpus is not None:
        need = -(-doc.gpus // doc.gpus_per_node)
        if need > len(names):
            raise JobSpecError(f"job needs {need} nodes, topology {topo.name!r} has {len(names)}")
        names = names[:need]
    if placement is Placement.SHUFFLED:
        names = list(names)
        random.Random(seed).shuffle(names)
    return JobSpec(
        name=doc.name,
        nodes=names,
        gpus_per_node=doc.gpus_per_node,
        tp=doc.tp,
        pp=doc.pp,
        grad_bytes=doc.grad_bytes,
        pp_bytes=doc.pp_bytes,
        tp_bytes=doc.tp_bytes,
        channels=doc.channels,
        qps_per_connection=doc.qps_per_connection,
    )


def _table(rows: list[Variant]) -> str:
    ideal = next(r for r in rows if r.name == "ideal")
    head = ["VARIANT", "ALLREDUCE_MS", "ALGBW_GBPS", "BUSBW_GBPS", "STEP_S", "PCT_OF_IDEAL"]
    body = [
        [
            r.name.replace(" ", "-").replace(",", ""),
            f"{r.allreduce_s * 1e3:.2f}",
            f"{r.algbw_bytes_per_s / 1e9:.2f}",
            f"{r.busbw_bytes_per_s / 1e9:.2f}",
            f"{r.step_s:.3f}",
            f"{100 * r.busbw_bytes_per_s / ideal.busbw_bytes_per_s:.1f}"
            if ideal.busbw_bytes_per_s
            else "-",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "   ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [head, *body]
    )


TopologyOpt = typer.Option(..., "--topology", "-t", help="Topology file (YAML or JSON).")
JobOpt = typer.Option(None, "--job", "-j", help="Job file (YAML/JSON); overrides the flags.")
GpusOpt = typer.Option(None, "--gpus", help="GPUs of the job (default: every node).")
PlacementOpt = typer.Option(Placement.LISTED, "--placement", help="Node order as launched.")


@app.command("simulate")
def simulate(
    topology: Path = TopologyOpt,
    job_file: Path | None = JobOpt,
    gpus: int | None = GpusOpt,
    placement: Placement = PlacementOpt,
    placement_seed: int = typer.Option(0, "--placement-seed"),
    tp: int = typer.Option(8, "--tp", min=1),
    pp: int = typer.Option(1, "--pp", min=1),
    size_mib: float = typer.Option(1024.0, "--size-mib", min=0.0, help="All-reduce size S."),
    channels: int = typer.Option(2, "--channels", min=1),
    qps: int = typer.Option(1, "--qps", min=1),
    seeds: int = typer.Option(20, "--seeds", min=1, help="ECMP draws."),
    compute_s: float = typer.Option(0.0, "--compute-s", min=0.0, help="Compute per step."),
    hash_function: str = typer.Option("crc32", "--hash", help="Switch ECMP hash to enforce."),
    output: Output = typer.Option(Output.TABLE, "--output", "-o"),
) -> None:
    """Compare ECMP hashing, our plan and the ideal bound for one job."""
    from controller.logic.traffic.compare import SimConfig, compare, unplanned_traffic
    from controller.logic.traffic.enforce import enforce
    from controller.logic.traffic.errors import TrafficError
    from controller.logic.traffic.hashing import HashConfig
    from controller.logic.traffic.planner import Planner
    from controller.logic.traffic.topofile import load_topology

    try:
        topo = load_topology(topology)
        job = _job(topo, job_file, gpus, placement, placement_seed, tp, pp, size_mib, channels, qps)
        planner = Planner(topo)
        plan = planner.plan(job)
        plan, _ports = enforce(plan, HashConfig(function=hash_function))
        base = unplanned_traffic(planner, job)
        rows = compare(plan, base, SimConfig(ecmp_seeds=seeds, compute_time_s=compute_s))
    except TrafficError as exc:
        _fail(str(exc))
    if output is Output.JSON:
        data: dict[str, Any] = {
            "plan": {"plan_id": plan.plan_id, "version": plan.version, **plan.stats()},
            "variants": [
                {
                    "name": r.name,
                    "allreduce_s": r.allreduce_s,
                    "algbw_bytes_per_s": r.algbw_bytes_per_s,
                    "busbw_bytes_per_s": r.busbw_bytes_per_s,
                    "step_s": r.step_s,
                    "phase_s": r.phase_s,
                }
                for r in rows
            ],
        }
        typer.echo(json.dumps(data))
    else:
        typer.echo(_table(rows))


@app.command("create")
def create(
    topology: Path = TopologyOpt,
    out: Path = typer.Option(..., "--out", help="Where to write the plan JSON."),
    qp_map_path: Path | None = typer.Option(None, "--qp-map", help="Also write the QP map."),
    job_file: Path | None = JobOpt,
    gpus: int | None = GpusOpt,
    placement: Placement = PlacementOpt,
    placement_seed: int = typer.Option(0, "--placement-seed"),
    tp: int = typer.Option(8, "--tp", min=1),
    pp: int = typer.Option(1, "--pp", min=1),
    size_mib: float = typer.Option(1024.0, "--size-mib", min=0.0),
    channels: int = typer.Option(2, "--channels", min=1),
    qps: int = typer.Option(1, "--qps", min=1),
    hash_function: str = typer.Option("crc32", "--hash"),
    link_down: list[str] = typer.Option([], "--link-down", help="'a--b' to plan around."),
) -> None:
    """Plan a job, enforce it under the hash model and write the plan (and QP map)."""
    from controller.logic.traffic.enforce import enforce
    from controller.logic.traffic.errors import TrafficError
    from controller.logic.traffic.hashing import HashConfig
    from controller.logic.traffic.outputs import plan_to_dict, qp_map, write_json_atomic
    from controller.logic.traffic.planner import Planner
    from controller.logic.traffic.topofile import load_topology

    try:
        topo = load_topology(topology)
        job = _job(topo, job_file, gpus, placement, placement_seed, tp, pp, size_mib, channels, qps)
        planner = Planner(topo)
        plan = planner.plan(job)
        if link_down:
            plan = planner.replan(plan, [(spec, 0.0) for spec in link_down])
        cfg = HashConfig(function=hash_function)
        plan, ports = enforce(plan, cfg)
        write_json_atomic(out, plan_to_dict(plan))
        if qp_map_path is not None:
            write_json_atomic(qp_map_path, qp_map(plan, ports, cfg))
    except TrafficError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename or out}: {exc.strerror or exc}")
    stats = plan.stats()
    typer.echo(
        f"plan {plan.plan_id} v{plan.version}: {stats['flows']} flows, max link time "
        f"{float(stats['max_link_time_s']) * 1e3:.2f} ms, written to {out}"  # type: ignore[arg-type]
    )


@app.command("show")
def show(
    plan_file: Path = typer.Argument(..., help="A plan JSON written by 'plan create'."),
    output: Output = typer.Option(Output.TABLE, "--output", "-o"),
) -> None:
    """Print a plan's summary: id, version, stats, launcher order, NCCL settings."""
    try:
        data = json.loads(read_text(plan_file))
    except Unreadable as exc:
        _fail(f"{plan_file}: {exc.reason}")
    except json.JSONDecodeError as exc:
        _fail(f"{plan_file}: not JSON ({exc.msg} at line {exc.lineno})")
    if not isinstance(data, dict) or data.get("format") != "trainguard.traffic.plan/v1":
        _fail(f"{plan_file}: not a trainguard traffic plan")
    if output is Output.JSON:
        data.pop("flows", None)
        typer.echo(json.dumps(data))
        return
    stats = data.get("stats", {})
    rows = [
        ("PLAN", str(data.get("plan_id"))),
        ("VERSION", str(data.get("version"))),
        ("JOB", str(data.get("job"))),
        ("FLOWS", str(stats.get("flows"))),
        ("MAX_LINK_TIME_MS", f"{float(stats.get('max_link_time_s', 0)) * 1e3:.3f}"),
        ("BUSIEST_LINK", str(stats.get("busiest_link") or "-")),
        ("BOND_IMBALANCE", f"{float(stats.get('bond_imbalance', 0)):.3f}"),
        ("CHANGES", str(len(data.get("changes", [])))),
        ("MOVED_FLOWS", str(stats.get("moved_flows", 0))),
        ("PLAN_TIME_MS", f"{float(stats.get('plan_time_s', 0)) * 1e3:.1f}"),
        ("NCCL_ENV", " ".join(f"{k}={v}" for k, v in data.get("nccl_env", {}).items())),
    ]
    width = max(len(k) for k, _ in rows)
    typer.echo("\n".join(f"{k.ljust(width)}   {v}" for k, v in rows))


from trainguard.cli import cmd_plan_api as cli_api  # noqa: E402  (registers ``plan list`` / ``plan get``)

cli_api.register(app)


def register(root: typer.Typer) -> None:
    """Mount ``trainguard plan …`` on the root command (imports only typer until it runs)."""
    root.add_typer(app, name="plan", rich_help_panel="More")


__all__ = ["app", "register"]
