"""``trainguard power …``: simulate oversubscription, generate traces, derive thresholds.

The CLI helper mounts :data:`app` under ``trainguard power``; it also runs on its own as
``python -m power.cli``. Imports of numpy and the simulator happen inside the commands so
``trainguard --help`` stays fast. Errors in the input are one line on stderr and exit 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from power.config import PolicyConfig, WorkloadKind
from power.errors import PowerError

if TYPE_CHECKING:
    from power.simulate import SimConfig

app = typer.Typer(
    name="power",
    help="Power oversubscription: simulate a row under a budget, generate traces, derive T1/T2.",
    no_args_is_help=True,
    add_completion=False,
)


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


class ControlOpt(StrEnum):
    NONE = "none"
    POLCA = "polca"
    REACTIVE = "reactive"


class TraceKind(StrEnum):
    INFERENCE = "inference"
    TRAINING = "training"


@contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except PowerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h).upper() for h in headers]] + [
        ["-" if v is None or v == "" else str(v) for v in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _policy(
    t1: float | None,
    t2: float | None,
    brake: float | None,
    hysteresis: float | None,
    hold: float | None,
    escalate: float | None,
) -> PolicyConfig:
    fields: dict[str, Any] = {
        "t1_frac": t1,
        "t2_frac": t2,
        "brake_frac": brake,
        "hysteresis_frac": hysteresis,
        "min_hold_s": hold,
        "escalate_after_s": escalate,
    }
    return PolicyConfig(**{k: v for k, v in fields.items() if v is not None})


Frac = Annotated[float | None, typer.Option(min=0.01, max=2.0)]


@app.command()
def simulate(
    trace: Annotated[Path, typer.Argument(help="Trace file (.csv or .parquet)")],
    base_servers: Annotated[int, typer.Option(min=1, help="Servers the budget was sized for")] = 40,
    extra: Annotated[int, typer.Option(min=0, help="Servers added under the same budget")] = 0,
    server_provisioned_w: Annotated[float, typer.Option(min=1.0)] = 4200.0,
    row_budget_w: Annotated[float | None, typer.Option(min=1.0)] = None,
    gpu_model: str = "NVIDIA A100-SXM4-80GB",
    gpus_per_server: Annotated[int, typer.Option(min=1)] = 8,
    control: ControlOpt = ControlOpt.POLCA,
    latency_s: Annotated[float, typer.Option(min=0.0, help="Command -> clocks changed")] = 0.05,
    tick_s: Annotated[float, typer.Option(min=0.001, help="Controller tick / report period")] = 1.0,
    t1: Frac = None,
    t2: Frac = None,
    brake: Frac = None,
    hysteresis: Annotated[float | None, typer.Option(min=0.0, max=0.5)] = None,
    min_hold_s: Annotated[float | None, typer.Option(min=0.0)] = None,
    escalate_after_s: Annotated[float | None, typer.Option(min=0.0)] = None,
    derive: Annotated[
        bool,
        typer.Option(
            help="Derive T1/T2 from the latency and a trace other than the one scored: "
            "--derive-from, else the trace's first half (then only the second half is replayed)"
        ),
    ] = False,
    derive_from: Annotated[
        Path | None,
        typer.Option(help="Trace to derive T1/T2 from (another day of the row); implies --derive"),
    ] = None,
    seed: int = 0,
    output: Annotated[Output, typer.Option("--output", "-o")] = Output.TABLE,
) -> None:
    """Replay a trace under a row budget with EXTRA servers and report what capping cost."""
    with _user_errors():
        from power.derive import derive_thresholds
        from power.simulate import Control, SimConfig, uncapped_row_w
        from power.simulate import simulate as run_sim
        from power.traces import load_trace

        tr = load_trace(trace)
        pol = _policy(t1, t2, brake, hysteresis, min_hold_s, escalate_after_s)
        budget = row_budget_w or base_servers * server_provisioned_w
        derived = None
        derived_from = ""
        if derive or derive_from is not None:
            # Never derive from the replayed steps: the spike would be known in advance.
            if derive_from is not None:
                src, derived_from = load_trace(derive_from), str(derive_from)
            else:
                half = tr.n_steps // 2
                if half < 2:
                    raise PowerError("simulate --derive: the trace is too short to split")
                src, tr = tr.steps(0, half), tr.steps(half, tr.n_steps)
                derived_from = f"first half of {trace} (steps 0-{half - 1}; replaying the rest)"
            derived = derive_thresholds(
                uncapped_row_w(src, base_servers + extra, seed=seed),
                budget,
                step_s=src.step_s,
                actuation_latency_s=latency_s,
                tick_interval_s=tick_s,
            )
            pol = derived.apply(pol)
        cfg = SimConfig(
            base_servers=base_servers,
            extra_servers=extra,
            server_provisioned_w=server_provisioned_w,
            row_budget_w=row_budget_w,
            gpu_model=gpu_model,
            gpus_per_server=gpus_per_server,
            control=Control(control.value),
            policy=pol,
            tick_interval_s=tick_s,
            actuation_latency_s=latency_s,
            seed=seed,
        )
        result = run_sim(tr, cfg)
    doc = result.as_dict()
    doc["policy"] = {
        "t1_frac": pol.t1_frac,
        "t2_frac": pol.t2_frac,
        "brake_frac": pol.brake_frac,
        "min_hold_s": pol.min_hold_s,
        "escalate_after_s": pol.escalate_after_s,
        "derived_from": derived_from or None,
    }
    if output is Output.JSON:
        typer.echo(json.dumps(doc, sort_keys=True))
        return
    rows: list[tuple[str, object]] = [
        (
            "servers",
            f"{result.servers} ({base_servers} + {extra}, +{result.extra_servers_pct:.1f}%)",
        ),
        ("control", f"{control.value}, latency {latency_s:g}s, tick {tick_s:g}s"),
        (
            "thresholds",
            f"T1 {pol.t1_frac:.1%}  T2 {pol.t2_frac:.1%}  brake {pol.brake_frac:.0%}"
            + (f" (derived from {derived_from})" if derived else ""),
        ),
        ("hp throughput loss", f"{result.hp_throughput_loss_pct:.2f}%"),
        ("lp throughput loss", f"{result.lp_throughput_loss_pct:.2f}%"),
        ("p50 latency impact", f"+{result.p50_latency_impact_pct:.2f}%"),
        ("p99 latency impact", f"+{result.p99_latency_impact_pct:.2f}%"),
        *[(f"time at {k}", f"{v:.0f}s") for k, v in result.time_capped_s.items()],
        ("brake events", result.brake_events),
        ("time above budget", f"{result.budget_violation_s:.0f}s"),
        ("worst overshoot", f"{result.worst_overshoot_pct:.2f}%"),
        ("peak row power", f"{result.peak_row_frac:.1%} of budget"),
        ("commands", result.commands),
    ]
    typer.echo(_table(["metric", "value"], rows))


@app.command()
def generate(
    out: Annotated[Path, typer.Argument(help="Where to write (.csv or .parquet)")],
    kind: TraceKind = TraceKind.INFERENCE,
    servers: Annotated[int, typer.Option(min=1, max=10_000)] = 40,
    duration_s: Annotated[float, typer.Option(min=2.0)] = 86_400.0,
    period_s: Annotated[float | None, typer.Option(min=1.0, help="Diurnal cycle length")] = None,
    step_s: Annotated[float, typer.Option(min=0.001)] = 1.0,
    low_priority_frac: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.5,
    seed: int = 0,
) -> None:
    """Write a seeded synthetic trace shaped like POLCA's published characterization."""
    with _user_errors():
        from power.generate import GeneratorConfig
        from power.generate import generate as gen
        from power.traces import save_trace

        cfg = GeneratorConfig(
            kind=WorkloadKind(kind.value),
            servers=servers,
            duration_s=duration_s,
            period_s=period_s or duration_s,
            step_s=step_s,
            low_priority_frac=low_priority_frac,
            seed=seed,
        )
        trace = gen(cfg)
        try:
            save_trace(trace, out)
        except OSError as exc:
            raise PowerError(f"{out}: cannot write: {exc.strerror or exc}") from None
        row = trace.row_power_w() / (servers * cfg.server_provisioned_w)
    typer.echo(
        f"wrote {out}: {servers} servers x {trace.n_steps} steps, "
        f"row peak {row.max():.1%} of provisioned"
    )


@app.command()
def derive(
    trace: Annotated[Path, typer.Argument(help="Trace file (.csv or .parquet)")],
    latency_s: Annotated[float, typer.Option(min=0.0, help="Measured command latency")] = 0.05,
    tick_s: Annotated[float, typer.Option(min=0.001)] = 1.0,
    base_servers: Annotated[int, typer.Option(min=1)] = 40,
    extra: Annotated[int, typer.Option(min=0)] = 0,
    server_provisioned_w: Annotated[float, typer.Option(min=1.0)] = 4200.0,
    margin: Annotated[float, typer.Option(min=0.0, max=0.2)] = 0.01,
    search: Annotated[bool, typer.Option(help="Also find how many servers each T2 allows")] = False,
    score_on: Annotated[
        Path | None,
        typer.Option(
            help="Held-out trace --search replays (another day); without it the search "
            "replays the trace the thresholds came from and says so (in_sample)"
        ),
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o")] = Output.TABLE,
) -> None:
    """Derive T2 (and T1) from the actuation latency and the trace's largest spike."""
    with _user_errors():
        from power.derive import derive_thresholds, max_rise_frac
        from power.search import max_extra_servers
        from power.simulate import SimConfig, uncapped_row_w
        from power.traces import load_trace

        tr = load_trace(trace)
        budget = base_servers * server_provisioned_w
        row = uncapped_row_w(tr, base_servers + extra)
        d = derive_thresholds(
            row,
            budget,
            step_s=tr.step_s,
            actuation_latency_s=latency_s,
            tick_interval_s=tick_s,
            margin_frac=margin,
        )
        polca_spike = max_rise_frac(row, budget, window_s=40.0 + tick_s, step_s=tr.step_s)
        doc: dict[str, Any] = {
            "window_s": d.window_s,
            "spike_pct": 100 * d.spike_frac,
            "t1_pct": 100 * d.t1_frac,
            "t2_pct": 100 * d.t2_frac,
            "t2_plus_spike_pct": 100 * (d.t2_frac + d.spike_frac),
            "polca_window_spike_pct": 100 * polca_spike,
            "polca_t2_plus_spike_pct": 100 * (0.89 + polca_spike),
            "min_hold_s": d.min_hold_s,
            "escalate_after_s": d.escalate_after_s,
        }
        if search:
            scored = tr if score_on is None else load_trace(score_on)
            doc["search_in_sample"] = score_on is None
            base = SimConfig(
                base_servers=base_servers,
                server_provisioned_w=server_provisioned_w,
                actuation_latency_s=latency_s,
                tick_interval_s=tick_s,
            )
            polca_cfg = _with_policy(
                base,
                PolicyConfig(
                    escalate_after_s=latency_s + 2 * tick_s, min_hold_s=max(15.0, 1.5 * d.window_s)
                ),
            )
            n_polca, _ = max_extra_servers(scored, polca_cfg)

            def ours(n: int) -> SimConfig:
                r = uncapped_row_w(tr, base_servers + n)
                dn = derive_thresholds(
                    r,
                    budget,
                    step_s=tr.step_s,
                    actuation_latency_s=latency_s,
                    tick_interval_s=tick_s,
                    margin_frac=margin,
                )
                return _with_policy(base, dn.apply(PolicyConfig()))

            n_ours, _ = max_extra_servers(scored, ours)
            doc["extra_servers_polca_thresholds"] = n_polca
            doc["extra_servers_derived_thresholds"] = n_ours
    doc = {k: round(v, 4) if isinstance(v, float) else v for k, v in doc.items()}
    if output is Output.JSON:
        typer.echo(json.dumps(doc, sort_keys=True))
        return
    typer.echo(
        _table(
            ["quantity", "value"],
            [(k, v if isinstance(v, bool) else f"{v:.4g}") for k, v in doc.items()],
        )
    )


def _with_policy(cfg: SimConfig, pol: PolicyConfig) -> SimConfig:
    import dataclasses

    return dataclasses.replace(cfg, policy=pol)


@app.command()
def domains(
    path: Annotated[Path, typer.Argument(help="Domain tree (.yaml, .yml or .json)")],
    output: Annotated[Output, typer.Option("--output", "-o")] = Output.TABLE,
) -> None:
    """Validate a power-domain file and show the tree with each domain's thresholds."""
    with _user_errors():
        from power.domains import load_domains

        tree = load_domains(path)
    items: list[dict[str, Any]] = []
    for dom in tree.root.walk():
        p = dom.policy
        items.append(
            {
                "name": dom.name,
                "kind": dom.kind.label,
                "depth": len(dom.ancestors()) - 1,
                "budget_w": dom.budget_w,
                "parent": dom.parent.name if dom.parent else None,
                "t1_frac": p.t1_frac,
                "t2_frac": p.t2_frac,
                "brake_frac": p.brake_frac,
                "knob": p.knob.value,
            }
        )
    if output is Output.JSON:
        typer.echo(json.dumps(items, sort_keys=True))
        return
    rows = [
        (
            "  " * int(i["depth"]) + str(i["name"]),
            i["kind"],
            f"{i['budget_w']:.0f}",
            f"{i['t1_frac']:.0%}",
            f"{i['t2_frac']:.0%}",
            f"{i['brake_frac']:.0%}",
            i["knob"],
        )
        for i in items
    ]
    typer.echo(_table(["name", "kind", "budget_w", "t1", "t2", "brake", "knob"], rows))


@app.command()
def clocks(output: Annotated[Output, typer.Option("--output", "-o")] = Output.TABLE) -> None:
    """Show the clock caps per GPU model and where the numbers come from."""
    from power.clocks import CLOCK_TABLE

    rows = [
        {
            "model": k,
            "min_mhz": p.min_mhz,
            "max_mhz": p.max_mhz,
            **dict(p.caps_mhz),
            "tdp_w": p.tdp_w,
            "power_limit_min_w": p.power_limit_min_w,
            "source": p.source,
        }
        for k, p in CLOCK_TABLE.items()
    ]
    if output is Output.JSON:
        typer.echo(json.dumps(rows, sort_keys=True))
        return
    cols: list[str] = [
        "model",
        "min_mhz",
        "lp_t2",
        "lp_t1",
        "hp_t2",
        "max_mhz",
        "tdp_w",
        "power_limit_min_w",
    ]
    typer.echo(_table(cols, [[r[c] for c in cols] for r in rows]))


@app.command()
def status(
    ctx: typer.Context,
    server: Annotated[
        str | None,
        typer.Option("--server", help="Controller base URL [env: TRAINGUARD_SERVER]."),
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="Viewer token [env: TRAINGUARD_TOKEN].")
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o")] = Output.TABLE,
) -> None:
    """Show the controller's power domains: budget, power, level and capped GPUs."""
    from trainguard.cli.options import connect

    with connect(ctx, server, token) as client:
        body = client.power_domains()
    if output is Output.JSON:
        typer.echo(json.dumps(body, sort_keys=True))
        return
    typer.echo(status_table(body))


def status_table(body: dict[str, Any]) -> str:
    """The kubectl-style table of ``GET /api/v1/power/domains`` (indented by depth)."""
    if not body.get("data"):
        return "no power domains configured"
    rows = []
    for d in body["data"]:
        util = d.get("utilization_pct")
        gpus = d.get("capped_gpus") or []
        rows.append(
            (
                "  " * int(d.get("depth", 0)) + str(d["name"]),
                f"{d['budget_w']:.0f}",
                "-" if d.get("power_w") is None else f"{d['power_w']:.0f}",
                "-" if util is None else f"{util:.1f}%",
                d.get("level", "NONE"),
                len(gpus),
                "yes" if d.get("stale") else "no",
            )
        )
    headers = ["domain", "budget-w", "power-w", "util", "level", "capped-gpus", "stale"]
    table = _table(headers, rows)
    lat = body.get("actuation_latency") or {}
    state = "enabled" if body.get("enabled") else "disabled (no commands sent)"
    footer = f"policy {state}; tree from {body.get('source', '?')}"
    if lat.get("p50_s") is not None:
        footer += (
            f"; command->ack p50 {lat['p50_s'] * 1000:.0f} ms, p99 {lat['p99_s'] * 1000:.0f} ms"
            f" ({lat['samples']} commands)"
        )
    return f"{table}\n{footer}"


def main() -> None:  # pragma: no cover - exercised through python -m
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
