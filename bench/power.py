"""POLCA's headline on synthetic rows: how many extra servers each control scheme sustains.

For a 40-server inference row and a 40-server training row from the seeded generator, search
the largest number of extra servers under the same budget that keeps high-priority
throughput loss <= 1%, low-priority <= 2%, zero brake events and zero seconds above budget,
for: no capping, POLCA's thresholds with its 40 s out-of-band actuation, POLCA's thresholds
in-band, a priority-blind reactive power-capping baseline (in-band), and ours (T1/T2 derived
from the in-band window) at the actuation latency measured in this run and at the agents' default
report interval. Then, at a fixed +30%, the same POLCA thresholds actuated in-band vs
out-of-band (40 s). Every number comes from running the simulator in this process
(*simulated*), except the actuation latency, which is *measured here* first: a controller
and an agent on simulated NVML run as real processes and the bench times "cap requested"
to "cap seen in the node's report" (``bench.power_actuation``); the in-band schemes use the
slowest sample.

Held-out rows of another shape (``bench.power_heldout``): every scheme's parameters (its
thresholds and the extra servers to deploy) are chosen on the training set (the inference
row below) and scored on a burstier row, a row with another job mix and a training row
with whole-job power swings, beside no oversubscription, static per-server caps and
POLCA's published thresholds. JSON: ``heldout_extra_servers_pct``, ``heldout_hp_loss_pct``
(ours, the worst held-out row), ``actuation_latency_s`` (measured), ``baselines``.

Held out: the derived thresholds never see the day they are scored on. They come from
another day of the same row (the generator at ``--derive-seed``, default ``--seed`` + 1000),
the way an operator would derive them from last week's telemetry; every scheme is scored on
the day at ``--seed``.

    python -m bench.power [--quick] [--json] [--seed N] [--derive-seed N] [--no-heldout]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace

from bench.power_actuation import measure_actuation
from bench.power_heldout import OURS as HELD_OURS
from bench.power_heldout import evaluate, heldout_traces, power_timeline
from power.config import PolicyConfig, Priority, WorkloadKind
from power.derive import derive_thresholds
from power.generate import SERVER_PROVISIONED_W, GeneratorConfig, generate
from power.search import Limits, max_extra_servers
from power.simulate import Control, SimConfig, SimResult, simulate, uncapped_row_w
from power.traces import Trace

BASE = 40
OOB_LATENCY_S = 40.0
TICK_S = 1.0
POLCA_OOB = PolicyConfig(escalate_after_s=OOB_LATENCY_S + TICK_S, min_hold_s=60.0)

DEFAULT_REPORT_S = 5.0
"""The agents' default ``report_interval_s`` (``agents.settings``): the controller sees a
node's power once per report and a command rides the reply to the node's next report, so
in the default deployment both the tick and the actuation latency are one report interval."""

DERIVE_SEED_OFFSET = 1000
"""The derivation day's seed is the scored day's plus this: a different day of the same row."""

OURS = "ours: derived, in-band"
OURS_DEFAULT = "ours: derived, 5 s reports"


def derived_policy(
    derive_trace: Trace, extra: int, *, latency_s: float, tick_s: float
) -> PolicyConfig:
    """T1/T2 for ``BASE + extra`` servers from the derivation trace (never the scored one)."""
    d = derive_thresholds(
        uncapped_row_w(derive_trace, BASE + extra),
        BASE * SERVER_PROVISIONED_W,
        step_s=derive_trace.step_s,
        actuation_latency_s=latency_s,
        tick_interval_s=tick_s,
    )
    return d.apply(PolicyConfig())


def schemes(
    derive_trace: Trace, latency_s: float
) -> list[tuple[str, SimConfig | Callable[[int], SimConfig]]]:
    """The schemes compared; the derived ones see only ``derive_trace``."""
    inband = SimConfig(base_servers=BASE, actuation_latency_s=latency_s, tick_interval_s=TICK_S)
    default = replace(
        inband, actuation_latency_s=DEFAULT_REPORT_S, tick_interval_s=DEFAULT_REPORT_S
    )
    polca_inband = PolicyConfig(escalate_after_s=latency_s + 2 * TICK_S, min_hold_s=15.0)

    def ours(extra: int) -> SimConfig:
        pol = derived_policy(derive_trace, extra, latency_s=latency_s, tick_s=TICK_S)
        return replace(inband, policy=pol)

    def ours_default(extra: int) -> SimConfig:
        pol = derived_policy(
            derive_trace, extra, latency_s=DEFAULT_REPORT_S, tick_s=DEFAULT_REPORT_S
        )
        return replace(default, policy=pol)

    return [
        ("no capping", replace(inband, control=Control.NONE)),
        (
            "POLCA, 40 s out-of-band",
            replace(inband, policy=POLCA_OOB, actuation_latency_s=OOB_LATENCY_S),
        ),
        ("POLCA thresholds, in-band", replace(inband, policy=polca_inband)),
        ("reactive power cap, in-band", replace(inband, control=Control.REACTIVE)),
        (OURS, ours),
        (OURS_DEFAULT, ours_default),
    ]


def row_traces(
    kind: WorkloadKind, *, quick: bool, seed: int, derive_seed: int
) -> tuple[Trace, Trace]:
    """The scored day and the derivation day: same generator settings, different seeds."""
    if seed == derive_seed:
        raise SystemExit("bench.power: --derive-seed must differ from --seed (held-out scoring)")
    duration = 4 * 3600.0 if quick else 86_400.0

    def day(s: int) -> Trace:
        return generate(
            GeneratorConfig(
                kind=kind, servers=BASE + 32, seed=s, duration_s=duration, period_s=duration
            )
        )

    return day(seed), day(derive_seed)


def run_row(
    kind: WorkloadKind, *, quick: bool, seed: int, derive_seed: int, latency_s: float
) -> dict[str, object]:
    t0 = time.perf_counter()
    trace, derive_trace = row_traces(kind, quick=quick, seed=seed, derive_seed=derive_seed)
    baseline = simulate(trace, SimConfig(base_servers=BASE, control=Control.NONE))
    rows = []
    for name, cfg in schemes(derive_trace, latency_s):
        extra, res = max_extra_servers(trace, cfg, limits=Limits(), upper=32)
        run_cfg = cfg(extra) if callable(cfg) else cfg
        pol = run_cfg.policy
        thresholds = run_cfg.control is Control.POLCA
        rows.append(
            {
                "scheme": name,
                "extra": extra,
                "result": res,
                "t1": pol.t1_frac if thresholds else None,
                "t2": pol.t2_frac if thresholds else None,
            }
        )
    return {
        "kind": kind.value,
        "duration_s": trace.n_steps * trace.step_s,
        "baseline": baseline,
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
        "trace": trace,
        "derive_trace": derive_trace,
    }


def inband_vs_oob(
    trace: Trace, derive_trace: Trace, latency_s: float, polca_extra: int, ours_extra: int
) -> list[tuple[str, SimResult]]:
    """The same thresholds actuated in-band and out-of-band: which margins each can hold."""
    derived = derived_policy(derive_trace, ours_extra, latency_s=latency_s, tick_s=TICK_S)
    polca_inband = replace(POLCA_OOB, escalate_after_s=latency_s + 2 * TICK_S)
    cases = [
        (f"POLCA +{polca_extra}, in-band", polca_extra, polca_inband, latency_s),
        (f"POLCA +{polca_extra}, 40 s", polca_extra, POLCA_OOB, OOB_LATENCY_S),
        (f"ours +{ours_extra}, in-band", ours_extra, derived, latency_s),
        (f"ours +{ours_extra}, 40 s", ours_extra, derived, OOB_LATENCY_S),
    ]
    return [
        (
            name,
            simulate(
                trace,
                SimConfig(
                    base_servers=BASE, extra_servers=extra, policy=pol, actuation_latency_s=lat
                ),
            ),
        )
        for name, extra, pol, lat in cases
    ]


def tick_cost(servers: int, gpus_per_server: int = 8, repeats: int = 5) -> dict[str, float]:
    """Median policy tick time for a datacenter of ``servers`` nodes: steady (nothing to
    change) vs. a tick where every row crosses T1 and every low-priority GPU gets a command.
    Baseline: aggregating the same readings up the tree, which any loop must do anyway."""
    import statistics

    from power.domains import Reading, parse_domains
    from power.policy import GpuStatus, PowerPolicy

    racks = max(1, servers // 16)
    rows = max(1, racks // 8)
    tree = parse_domains(
        {
            "name": "dc",
            "kind": "datacenter",
            "budget_w": 1e9,
            "children": [
                {
                    "name": f"row-{r}",
                    "kind": "row",
                    "budget_w": 1000.0 * servers / rows,
                    "children": [
                        {
                            "name": f"rack-{r}-{k}",
                            "kind": "rack",
                            "budget_w": 1e7,
                            "children": [
                                {"name": f"n-{r}-{k}-{i}", "kind": "server", "budget_w": 1e5}
                                for i in range(16)
                            ],
                        }
                        for k in range(racks // rows)
                    ],
                }
                for r in range(rows)
            ],
        }
    )
    names = [d.name for d in tree.servers()]
    gpus = [
        GpuStatus(
            server=n,
            index=g,
            model="NVIDIA H100 80GB HBM3",
            priority=Priority.LOW if g % 2 else Priority.HIGH,
        )
        for n in names
        for g in range(gpus_per_server)
    ]

    def readings(per_server_w: float, now: float) -> dict[str, Reading]:
        return {n: Reading(per_server_w, now) for n in names}

    out: dict[str, list[float]] = {"aggregate": [], "steady": [], "cross_t1": []}
    for rep in range(repeats):
        policy = PowerPolicy(tree)
        now = 10.0 * rep
        policy.tick(now, readings(500.0, now), gpus)
        r = readings(500.0, now + 1)
        t0 = time.perf_counter()
        tree.aggregate(r, now_s=now + 1, stale_after_s=10.0)
        out["aggregate"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        policy.tick(now + 1, r, gpus)
        out["steady"].append(time.perf_counter() - t0)
        hot = readings(850.0, now + 2)
        t0 = time.perf_counter()
        res = policy.tick(now + 2, hot, gpus)
        out["cross_t1"].append(time.perf_counter() - t0)
        assert len(res.decisions) == len(gpus) // 2
    return {k: 1000 * statistics.median(v) for k, v in out.items()}


def heldout_section(train_trace: Trace, args: argparse.Namespace) -> dict[str, object]:
    """Parameters from the training set (``train_trace``), figures on rows of other shapes."""
    t0 = time.perf_counter()
    duration = 2 * 3600.0 if args.quick else 86_400.0
    n = train_trace.n_steps
    # --quick: the middle half of the training day, around its peak (what sets the answer).
    train = train_trace.steps(n // 4, 3 * n // 4) if args.quick else train_trace
    rows = evaluate(train, heldout_traces(seed=args.seed, duration_s=duration), args.latency_s)
    print(
        f"\nHeld out (simulated): parameters chosen on the training row, scored on rows of "
        f"other shapes ({duration / 3600:g} h each, {time.perf_counter() - t0:.1f} s)"
    )
    print(
        f"{'SCHEME':62s} {'CHOSEN':>7s} {'ROW':16s} {'HP_LOSS':>8s} {'LP_LOSS':>8s} "
        f"{'BRAKE':>5s} {'OVER':>6s} {'OK':>3s} {'MAX_EXTRA':>9s}"
    )
    for r in rows:
        for name, h in r["heldout_rows"].items():
            a = h["at_chosen"]
            print(
                f"{r['name']:62s} {r['chosen_extra_servers_pct']:>6.1f}% {name:16s} "
                f"{a['hp_loss_pct']:>7.2f}% {a['lp_loss_pct']:>7.2f}% {a['brake_events']:>5d} "
                f"{a['violation_s']:>5.0f}s {'yes' if a['limits_met'] else 'NO':>3s} "
                f"{h['max_extra_servers_pct']:>8.1f}%"
            )
    ours = next(r for r in rows if r["name"] == HELD_OURS)
    trace = heldout_traces(seed=args.seed, duration_s=duration)["bursty"]
    chosen = round(ours["chosen_extra_servers_pct"] * BASE / 100)
    cfg = SimConfig(
        base_servers=BASE,
        extra_servers=chosen,
        actuation_latency_s=args.latency_s,
        tick_interval_s=TICK_S,
        policy=derived_policy(train, chosen, latency_s=args.latency_s, tick_s=TICK_S),
    )
    return {
        "heldout_extra_servers_pct": ours["heldout_extra_servers_pct"],
        "heldout_hp_loss_pct": ours["heldout_hp_loss_pct"],
        "heldout_limits_met_at_chosen": ours["heldout_limits_met_at_chosen"],
        "heldout": ours,
        "baselines": [r for r in rows if r is not ours],
        "timeline_bursty_ours": {**power_timeline(trace, cfg), "extra_servers": chosen},
        "heldout_note": (
            "simulated; parameters (thresholds, extra servers) chosen on the training row, "
            "scored on held-out rows; the latency fed in is measured here"
        ),
    }


def fmt_row(name: str, extra: int, t1: float | None, t2: float | None, r: SimResult) -> str:
    th = "-" if t1 is None else f"{t1:.1%}/{t2:.1%}"
    return (
        f"{name:30s} {extra:>3d} {100 * extra / BASE:>6.1f}% {th:>11s} "
        f"{r.hp_throughput_loss_pct:>6.2f}% {r.lp_throughput_loss_pct:>6.2f}% "
        f"{r.p99_latency_impact_pct:>7.1f}% {r.brake_events:>5d} {r.budget_violation_s:>6.0f}s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 4 h compressed day instead of 24 h")
    ap.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    ap.add_argument("--seed", type=int, default=0, help="the day every scheme is scored on")
    ap.add_argument(
        "--derive-seed",
        type=int,
        default=None,
        help=f"the day derived thresholds come from (default: seed + {DERIVE_SEED_OFFSET})",
    )
    ap.add_argument(
        "--latency-samples", type=int, default=5, help="caps timed through the agent path"
    )
    ap.add_argument("--no-heldout", action="store_true", help="skip the held-out rows")
    args = ap.parse_args()
    if args.latency_samples < 1:
        ap.error("--latency-samples must be >= 1")
    derive_seed = args.seed + DERIVE_SEED_OFFSET if args.derive_seed is None else args.derive_seed
    try:
        actuation = measure_actuation(samples=args.latency_samples, report_interval_s=TICK_S)
    except RuntimeError as exc:
        raise SystemExit(f"bench.power: could not measure the actuation latency: {exc}") from None
    args.latency_s = float(actuation["max_s"])
    print(
        f"actuation latency, measured here (controller + agent processes, simulated NVML, "
        f"{TICK_S:g} s reports): p50 {actuation['p50_s']} s, max {actuation['max_s']} s "
        f"over {args.latency_samples} caps; the simulator uses the max"
    )

    header = (
        f"{'SCHEME':30s} {'+N':>3s} {'EXTRA':>7s} {'T1/T2':>11s} {'HP_LOSS':>7s} "
        f"{'LP_LOSS':>7s} {'P99_LAT':>8s} {'BRAKE':>5s} {'OVER':>7s}"
    )
    summary: dict[str, object] = {}
    for kind in (WorkloadKind.INFERENCE, WorkloadKind.TRAINING):
        res = run_row(
            kind,
            quick=args.quick,
            seed=args.seed,
            derive_seed=derive_seed,
            latency_s=args.latency_s,
        )
        hours: float = res["duration_s"] / 3600  # type: ignore[operator]
        print(
            f"\n{kind.value} row: {BASE} servers, {hours:g} h trace, "
            f"scored on seed {args.seed}, thresholds derived from seed {derive_seed}; "
            f"in-band {args.latency_s:g} s + {TICK_S:g} s tick, default agents "
            f"{DEFAULT_REPORT_S:g} s + {DEFAULT_REPORT_S:g} s; "
            f"limits HP<=1%, LP<=2%, 0 brakes, 0 s over budget ({res['elapsed_s']:.1f} s)"
        )
        print(header)
        base: SimResult = res["baseline"]  # type: ignore[assignment]
        print(fmt_row("no oversubscription", 0, None, None, base))
        rows: list[dict] = res["rows"]  # type: ignore[type-arg, assignment]
        for row in rows:
            print(fmt_row(row["scheme"], row["extra"], row["t1"], row["t2"], row["result"]))
        by = {row["scheme"]: row for row in rows}
        prefix = "" if kind is WorkloadKind.INFERENCE else "training_"
        ours = by[OURS]
        summary[f"{prefix}extra_servers_pct_none"] = 100 * by["no capping"]["extra"] / BASE
        summary[f"{prefix}extra_servers_pct_polca"] = (
            100 * by["POLCA, 40 s out-of-band"]["extra"] / BASE
        )
        summary[f"{prefix}extra_servers_pct_polca_inband"] = (
            100 * by["POLCA thresholds, in-band"]["extra"] / BASE
        )
        summary[f"{prefix}extra_servers_pct_reactive"] = (
            100 * by["reactive power cap, in-band"]["extra"] / BASE
        )
        summary[f"{prefix}extra_servers_pct_ours"] = 100 * ours["extra"] / BASE
        summary[f"{prefix}extra_servers_pct_ours_default_report"] = (
            100 * by[OURS_DEFAULT]["extra"] / BASE
        )
        if kind is WorkloadKind.INFERENCE:
            r: SimResult = ours["result"]
            summary.update(
                hp_throughput_loss_pct=round(r.hp_throughput_loss_pct, 3),
                lp_throughput_loss_pct=round(r.lp_throughput_loss_pct, 3),
                brake_events=r.brake_events,
                budget_violation_s=r.budget_violation_s,
                p99_latency_impact_pct=round(r.p99_latency_impact_pct, 2),
                ours_t1_pct=round(100 * ours["t1"], 2),
                ours_t2_pct=round(100 * ours["t2"], 2),
                ours_latency_s=args.latency_s,
                actuation_latency_s=args.latency_s,
                actuation=actuation,
                seed=args.seed,
                derive_seed=derive_seed,
            )
            trace: Trace = res["trace"]  # type: ignore[assignment]
            derive_trace: Trace = res["derive_trace"]  # type: ignore[assignment]
            cmp = inband_vs_oob(trace, derive_trace, args.latency_s, 12, int(ours["extra"]))
            print(
                f"\nSame thresholds, in-band ({args.latency_s * 1000:g} ms) vs out-of-band "
                f"({OOB_LATENCY_S:g} s) actuation"
            )
            print(
                f"{'CASE':22s} {'HP_LOSS':>7s} {'LP_LOSS':>7s} {'BRAKE':>5s} "
                f"{'OVER':>6s} {'WORST':>6s} {'PEAK':>6s}"
            )
            for name, rr in cmp:
                print(
                    f"{name:22s} {rr.hp_throughput_loss_pct:>6.2f}% "
                    f"{rr.lp_throughput_loss_pct:>6.2f}% {rr.brake_events:>5d} "
                    f"{rr.budget_violation_s:>5.0f}s {rr.worst_overshoot_pct:>5.2f}% "
                    f"{100 * rr.peak_row_frac:>5.1f}%"
                )
            ours_oob = cmp[3][1]
            summary["ours_thresholds_at_40s_brake_events"] = ours_oob.brake_events
            summary["ours_thresholds_at_40s_violation_s"] = ours_oob.budget_violation_s
            summary["polca_at_30pct_peak_pct_inband"] = round(100 * cmp[0][1].peak_row_frac, 2)
            summary["polca_at_30pct_peak_pct_40s"] = round(100 * cmp[1][1].peak_row_frac, 2)
            if not args.no_heldout:
                summary.update(heldout_section(derive_trace, args))
    sizes = [256] if args.quick else [256, 2048]
    print("\nPolicy tick cost (median ms per tick; baseline: aggregating the readings alone)")
    print(f"{'SERVERS':>8s} {'GPUS':>6s} {'AGGREGATE':>10s} {'STEADY':>8s} {'CROSS_T1':>9s}")
    for n in sizes:
        c = tick_cost(n, repeats=3 if args.quick else 5)
        print(
            f"{n:>8d} {8 * n:>6d} {c['aggregate']:>9.2f}  {c['steady']:>7.2f}  "
            f"{c['cross_t1']:>8.2f}"
        )
        summary[f"tick_ms_{8 * n}_gpus_steady"] = round(c["steady"], 3)
        summary[f"tick_ms_{8 * n}_gpus_cross_t1"] = round(c["cross_t1"], 3)
    ordered = {
        k: summary.get(k)
        for k in (
            "heldout_extra_servers_pct",
            "heldout_hp_loss_pct",
            "actuation_latency_s",
            "baselines",
            "extra_servers_pct_polca",
            "extra_servers_pct_ours",
            "hp_throughput_loss_pct",
            "lp_throughput_loss_pct",
            "brake_events",
            "budget_violation_s",
        )
    }
    ordered.update({k: v for k, v in summary.items() if k not in ordered})
    if args.json:
        print(json.dumps(ordered))


if __name__ == "__main__":
    main()
