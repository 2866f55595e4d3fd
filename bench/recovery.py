"""Fault to training resumed: the demo's drills, repeated, measured from the outside.

Each run starts a fresh local cluster (controller with the local-process actuator, three
simulated nodes, the TP=2 x DP=2 demo job with a spare node) and injects, one after
another, a straggler, a hang and a fatal XID (``trainguard.cli.drill``), with ``--gap-s``
of healthy training between faults and after the last. Per fault kind: detection time
(fault injected to incident opened), MTTR (fault injected to the first step of the
restarted job), steps run again; per run: the job's goodput (productive / wall time, from
the controller's ledger). The targets of issue #5 are printed next to the results, with
the figures they come from (MegaScale: up to 15 min to recover; TorchPass: under 2 min).

Baseline (``baseline_*`` keys), run in the same invocation: the demo job under real
``torchrun --max-restarts=3`` with the same periodic checkpoints and the same fault
schedule, with nobody watching (``bench/recovery_torchrun.py`` says how each fault reaches
it). Everything is PyTorch's default except the process groups' timeout, which is
``--baseline-timeout-s`` (30 min would make every run last half an hour); the figures
are also given extrapolated to gloo's and NCCL's default timeouts, labelled so.

    python -m bench.recovery [--quick] [--json] [--repeats N] [--gap-s S] [--baseline-timeout-s S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainguard.cli.drill import FAULT_KINDS, Drill, DrillConfig
from trainguard.cli.procs import ProcessSet

from .recovery_torchrun import BaselineConfig, run_baseline

TARGET_MTTR_S = 60.0
TARGET_GOODPUT_PCT = 90.0
#: Seconds of one demo-job step on this machine, to turn --gap-s into healthy steps.
STEP_S_GUESS = 0.18


def one_run(gap_s: float, verbose: bool) -> dict[str, Any]:
    steps = max(25, int(gap_s / STEP_S_GUESS))
    config = DrillConfig(warmup_steps=steps)
    t0 = time.monotonic()

    def say(line: str) -> None:
        if verbose:
            print(f"  [{time.monotonic() - t0:6.1f}s] {line}", file=sys.stderr, flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="tg-bench-recovery-") as tmp,
        ProcessSet(Path(tmp) / "logs") as procs,
    ):
        drill = Drill(config, Path(tmp), procs, say=say)
        drill.start()
        outcomes = [drill.fault(kind) for kind in FAULT_KINDS]
        # Healthy training after the last recovery too: goodput is over the whole run.
        gen = drill.generation()
        drill.wait(
            "training after the last fault",
            lambda: sum(1 for r in drill.losses() if r["generation"] == gen) >= steps,
            config.recovery_timeout_s + gap_s * 2,
        )
        goodput = drill.goodput()
        losses = drill.losses()
    gen0 = [float(r["time_unix_s"]) for r in losses if r["generation"] == 0]
    gaps = [b - a for a, b in itertools.pairwise(gen0)]
    return {
        "step_s": statistics.median(gaps) if gaps else STEP_S_GUESS,
        "warmup_steps": steps,
        "straggler_delay_s": config.straggler_delay_s,
        "faults": [o.as_dict() for o in outcomes],
        "ckpt_every": config.ckpt_every,
        "goodput_pct": 100.0 * float(goodput.get("ettr") or 0.0),
        "wall_s": goodput.get("wall_s"),
        "lost_s": goodput.get("lost_s"),
    }


def pg_default_timeout_s() -> float:
    """The installed torch's default process-group timeout (gloo's: the demo's backend)."""
    from torch.distributed.constants import default_pg_timeout

    return float(default_pg_timeout.total_seconds())


def baseline_run(run: dict[str, Any], timeout_s: float, verbose: bool) -> dict[str, Any]:
    """torchrun on the schedule of trainguard's ``run`` (same steps between faults)."""
    cfg = BaselineConfig(
        warmup_steps=int(run["warmup_steps"]),
        straggler_delay_s=float(run["straggler_delay_s"]),
        ckpt_every=int(run["ckpt_every"]),
        step_sleep_s=DrillConfig().step_sleep_s,
        pg_timeout_s=timeout_s,
        default_timeout_s=pg_default_timeout_s(),
    )
    with tempfile.TemporaryDirectory(prefix="tg-bench-torchrun-") as tmp:
        say = (lambda line: print(f"  {line}", file=sys.stderr, flush=True)) if verbose else None
        return run_baseline(cfg, Path(tmp), say=say)


def summarize(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    faults = [f for run in runs for f in run["faults"]]
    mttr = [f["recover_s"] for f in faults if f["recover_s"] is not None]
    lost = [f["steps_lost"] for f in faults if f["steps_lost"] is not None]
    scenarios = []
    for kind in FAULT_KINDS:
        mine = [f for f in faults if f["fault"] == kind]
        scenarios.append(
            {
                "fault": kind,
                "runs": len(mine),
                "detect_s_p50": statistics.median(f["detect_s"] for f in mine),
                "mttr_s_p50": statistics.median(f["recover_s"] for f in mine),
                "mttr_s_max": max(f["recover_s"] for f in mine),
                "steps_lost_max": max(f["steps_lost"] for f in mine),
                "world_after": [f["world_after"] for f in mine],
            }
        )
    b_mttr = [b["mttr_s"] for b in base if b["mttr_s"] is not None]

    def med(key: str, where: str = "") -> float | None:
        vals = [(b[where] if where else b)[key] for b in base]
        vals = [v for v in vals if v is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {
        "goodput": round(statistics.median(r["goodput_pct"] for r in runs) / 100, 4),
        "baseline_goodput": med("goodput"),
        "mttr_s": round(statistics.median(mttr), 2),
        "baseline_mttr_s": round(statistics.median(b_mttr), 2) if b_mttr else None,
        "steps_lost": max(sum(f["steps_lost"] or 0 for f in r["faults"]) for r in runs),
        "baseline_steps_lost": max(b["steps_lost"] for b in base),
        "baseline_unrecovered": base[0]["unrecovered"],
        "baseline": base[0],
        "baseline_goodput_default_timeout": med("goodput", "at_default_timeout"),
        "baseline_mttr_s_default_timeout": med("mttr_s", "at_default_timeout"),
        "baseline_goodput_nccl_timeout": med("goodput", "at_nccl_default_timeout"),
        "baseline_mttr_s_nccl_timeout": med("mttr_s", "at_nccl_default_timeout"),
        "labels": {
            "goodput": "measured here (real processes: controller, agents, gloo demo job)",
            "baseline_goodput": base[0]["how"],
            "baseline_goodput_default_timeout": base[0]["at_default_timeout"]["how"],
        },
        "mttr_s_p50": statistics.median(mttr),
        "mttr_s_max": max(mttr),
        "steps_lost_max": max(lost),
        "ckpt_every": runs[0]["ckpt_every"],
        "goodput_pct": statistics.median(r["goodput_pct"] for r in runs),
        "goodput_pct_min": min(r["goodput_pct"] for r in runs),
        "runs": len(runs),
        "scenarios": scenarios,
    }


def table(summary: dict[str, Any], gap_s: float) -> str:
    head = f"{'fault':<10} {'runs':>4} {'detect p50':>11} {'MTTR p50':>9} {'MTTR max':>9} "
    head += f"{'steps lost max':>15}  world after"
    lines = [head]
    for s in summary["scenarios"]:
        lines.append(
            f"{s['fault']:<10} {s['runs']:>4} {s['detect_s_p50']:>10.1f}s {s['mttr_s_p50']:>8.1f}s "
            f"{s['mttr_s_max']:>8.1f}s {s['steps_lost_max']:>15}  {s['world_after']}"
        )
    ok = summary["mttr_s_max"] <= TARGET_MTTR_S
    lines += [
        "",
        f"MTTR max {summary['mttr_s_max']:.1f} s  (target <= {TARGET_MTTR_S:.0f} s: "
        f"{'met' if ok else 'NOT met'}; MegaScale up to 15 min, TorchPass < 2 min)",
        f"steps lost max {summary['steps_lost_max']}  (target <= checkpoint interval "
        f"{summary['ckpt_every']}: "
        f"{'met' if summary['steps_lost_max'] <= summary['ckpt_every'] else 'NOT met'})",
        f"goodput {summary['goodput_pct']:.1f} % median, {summary['goodput_pct_min']:.1f} % min "
        f"over runs with 3 faults and {gap_s:.0f} s of training between them (target >= "
        f"{TARGET_GOODPUT_PCT:.0f} %: "
        f"{'met' if summary['goodput_pct_min'] >= TARGET_GOODPUT_PCT else 'NOT met'})",
        "",
        "side by side, both measured here (torchrun: process-group timeout "
        f"{summary['baseline']['inputs']['pg_timeout_s']:.0f} s, see below):",
        f"{'':<22} {'trainguard':>12} {'torchrun':>19}",
        f"{'goodput (ETTR)':<22} {summary['goodput']:>12.3f} {summary['baseline_goodput']:>19.3f}",
        f"{'MTTR p50 (recovered)':<22} {summary['mttr_s']:>11.1f}s "
        f"{_s(summary['baseline_mttr_s']):>19}",
        f"{'steps lost':<22} {summary['steps_lost']:>12} {summary['baseline_steps_lost']:>19}",
        f"baseline never recovers from: {', '.join(summary['baseline_unrecovered']) or '-'}; "
        f"torchrun extrapolated to gloo's default timeout: goodput "
        f"{summary['baseline_goodput_default_timeout']:.3f}, MTTR "
        f"{_s(summary['baseline_mttr_s_default_timeout'])}; to NCCL's 10 min: goodput "
        f"{summary['baseline_goodput_nccl_timeout']:.3f}, MTTR "
        f"{_s(summary['baseline_mttr_s_nccl_timeout'])}",
    ]
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one run, 10 s between faults")
    ap.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    ap.add_argument("--repeats", type=int, default=None, help="runs (default 3; --quick 1)")
    ap.add_argument("--gap-s", type=float, default=None, help="training between faults")
    ap.add_argument("--verbose", action="store_true", help="narrate each drill on stderr")
    ap.add_argument(
        "--baseline-timeout-s",
        type=float,
        default=None,
        help="the torchrun baseline's process-group timeout (default 60; --quick 20; "
        "1800 measures gloo's default outright)",
    )
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    gap_s = args.gap_s if args.gap_s is not None else (10.0 if args.quick else 150.0)
    timeout_s = args.baseline_timeout_s or (20.0 if args.quick else 60.0)
    if repeats < 1 or gap_s < 0 or timeout_s <= 0:
        ap.error("--repeats must be >= 1, --gap-s >= 0 and --baseline-timeout-s > 0")
    runs: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    for i in range(repeats):
        print(f"run {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
        runs.append(one_run(gap_s, args.verbose))
        print(f"baseline {i + 1}/{repeats} (torchrun) ...", file=sys.stderr, flush=True)
        base.append(baseline_run(runs[-1], timeout_s, args.verbose))
    summary = summarize(runs, base)
    print(table(summary, gap_s))
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
