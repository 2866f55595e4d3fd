"""Run every benchmark and write ``bench/results/``: one JSON per bench, plots, a report.

``make bench`` calls this: each ``bench.<name>`` runs as its own process with ``--json``
(and ``--quick`` unless ``--full``), its last stdout line is kept as
``bench/results/<name>.json`` and its whole output as ``<name>.log``. Then ``REPORT.md``
lists the machine (cores, CPU model, disk, torch version, load while it ran), each bench's
command, how its figures were obtained (*measured here*, *simulated*, *derived*, *GPU: not
measured yet*) and its headline figures, with matplotlib plots: detection time CDFs
(trainguard vs. its baselines), goodput bars (trainguard vs. torchrun), and a row's power
over time against its budget.

    python -m bench.report [--full] [--only NAME ...] [--report-only]

``--report-only`` rebuilds the report and plots from the JSON files already there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BENCHES = (
    "ingest",
    "detect",
    "collectives",
    "power",
    "traffic",
    "traffic_api",
    "checkpoint",
    "recovery",
    "dashboard",
)
LABELS = {
    "ingest": "measured here (real controller, HTTP, SQLite/PostgreSQL)",
    "detect": "simulated scenario matrix and fleet sets through the real detectors; gloo "
    "runs measured here; baselines derived (documented PyTorch defaults)",
    "collectives": "measured here (gloo on CPU); GPU: not measured yet",
    "power": "simulated (trace-driven); actuation latency measured here",
    "traffic": "simulated (flow-level model)",
    "traffic_api": "measured here (real controller)",
    "checkpoint": "measured here (CPU, local disk)",
    "recovery": "measured here (real processes), trainguard and torchrun side by side; "
    "torchrun at the default timeouts extrapolated",
    "dashboard": "measured here (real controller, Chromium)",
}
HEADLINES = {
    "power": [
        "heldout_extra_servers_pct",
        "heldout_hp_loss_pct",
        "heldout_limits_met_at_chosen",
        "actuation_latency_s",
        "extra_servers_pct_ours",
        "extra_servers_pct_polca",
    ],
    "traffic": ["busbw_gain_vs_ecmp_median_pct", "pct_of_ideal", "hard_pct_of_ideal"],
    "recovery": [
        "goodput",
        "baseline_goodput",
        "mttr_s",
        "baseline_mttr_s",
        "steps_lost",
        "baseline_steps_lost",
        "baseline_unrecovered",
    ],
    "detect": [
        "localization_accuracy",
        "false_positives_per_1k_steps",
        "hang_detect_s_p50",
        "straggler_detect_steps_p50",
    ],
}


def machine() -> dict[str, Any]:
    """What the figures ran on: the first thing a reader needs to weigh them."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    disk = shutil.disk_usage(RESULTS.parent)
    dev = "?"
    try:
        out = subprocess.run(
            ["df", "--output=source,fstype", str(RESULTS.parent)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
        dev = out[-1].strip() if len(out) > 1 else "?"
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu,
        "disk": f"{dev}, {disk.total / 2**30:.0f} GiB, {disk.free / 2**30:.0f} GiB free",
        "torch": torch_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "gpu": "none (CPU only)",
    }


def run_bench(name: str, *, quick: bool) -> dict[str, Any]:
    """One bench as its own process; its last stdout line is its JSON summary."""
    argv = [sys.executable, "-m", f"bench.{name}", "--json"] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    (RESULTS / f"{name}.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    meta = {
        "command": f"python -m bench.{name} --json" + (" --quick" if quick else ""),
        "exit_status": proc.returncode,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "label": LABELS.get(name, "?"),
        "quick": quick,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        data = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        data = None
    result = {"_run": meta, **(data if isinstance(data, dict) else {"_failed": True})}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_detection_cdf(detect: dict[str, Any], out: Path) -> bool:
    """Detection time CDFs: trainguard's per scenario run, and each baseline's."""
    # Each series over all its fault runs: a fault never detected (None) keeps the curve
    # below 1, so a baseline that misses stragglers does not look complete.
    raw: list[tuple[str, list[Any]]] = [("trainguard", list(detect.get("detect_s") or []))]
    for b in detect.get("baselines", []):
        if "detect_s" in b:
            raw.append((b["name"], list(b["detect_s"])))
    series = [(n, sorted(float(x) for x in v if x is not None), len(v)) for n, v in raw if v]
    if not series:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, v, total in series:
        ax.step(v, [(i + 1) / total for i in range(len(v))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("fault -> detected (s, log)")
    ax.set_ylabel("fraction of fault runs detected")
    ax.set_title("Detection time (simulated matrix; baselines derived)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_goodput(recovery: dict[str, Any], out: Path) -> bool:
    if "goodput" not in recovery or "baseline_goodput" not in recovery:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    names = ["trainguard\n(measured here)", "torchrun --max-restarts\n(measured here)"]
    values = [100 * recovery["goodput"], 100 * recovery["baseline_goodput"]]
    ax.bar(names, values, color=["tab:blue", "tab:gray"])
    for i, v in enumerate(values):
        ax.text(i, v + 1, f"{v:.1f}%", ha="center")
    ax.set_ylabel("goodput (ETTR, %)")
    ax.set_ylim(0, 100)
    ax.set_title("Same fault schedule: straggler, hang, GPU lost")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_power(power: dict[str, Any], out: Path) -> bool:
    tl = power.get("timeline_bursty_ours")
    if not tl:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    hours = [t / 3600 for t in tl["t_s"]]
    ax.plot(hours, [100 * x for x in tl["uncapped_frac"]], lw=0.8, label="uncapped demand")
    ax.plot(hours, [100 * x for x in tl["controlled_frac"]], lw=0.8, label="with trainguard")
    ax.axhline(100, color="red", lw=1, label="budget")
    ax.set_xlabel("hours")
    ax.set_ylabel("row power (% of budget)")
    ax.set_title(f"Held-out bursty row, +{tl['extra_servers']} servers (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "-" if v is None else str(v)


def write_report(names: list[str], note: str) -> Path:
    info = machine()
    lines = [
        "# Benchmark results",
        "",
        "Written by `python -m bench.report` (what `make bench` runs). " + note,
        "",
        "## Machine",
        "",
        f"- cores: {info['cores']}; CPU: {info['cpu_model']}; GPU: {info['gpu']}",
        f"- disk: {info['disk']}",
        f"- torch {info['torch']}, Python {info['python']}, {info['platform']}",
        f"- load average when the report was written (1/5/15 min): {info['load_avg_1_5_15']}",
        "",
        "## Benches",
        "",
        "| bench | how obtained | command | status | headline figures |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        data = load(name)
        if data is None:
            lines.append(f"| {name} | {LABELS.get(name, '?')} | - | not run | - |")
            continue
        meta = data.get("_run", {})
        took = f" ({meta['elapsed_s']} s)" if meta.get("elapsed_s") is not None else ""
        status = "failed" if data.get("_failed") else f"ok{took}"
        heads = "; ".join(
            f"{k} = {_fmt(data.get(k))}" for k in HEADLINES.get(name, []) if k in data
        )
        lines.append(
            f"| {name} | {meta.get('label', LABELS.get(name))} | `{meta.get('command')}` | "
            f"{status} | {heads or f'see {name}.json'} |"
        )
    plots = []
    detect, recovery, power = load("detect"), load("recovery"), load("power")
    if detect and plot_detection_cdf(detect, RESULTS / "detection_cdf.png"):
        plots.append(("Detection time CDFs", "detection_cdf.png"))
    if recovery and plot_goodput(recovery, RESULTS / "goodput.png"):
        plots.append(("Goodput, trainguard vs torchrun", "goodput.png"))
    if power and plot_power(power, RESULTS / "power_timeline.png"):
        plots.append(("Row power over time vs budget", "power_timeline.png"))
    if plots:
        lines += ["", "## Plots", ""]
        for title, file in plots:
            lines += [f"### {title}", "", f"![{title}]({file})", ""]
    traffic = load("traffic")
    if traffic and traffic.get("ecmp_settings"):
        lines += [
            "",
            "## ECMP across flows per connection (simulated, flow-level model)",
            "",
            "| channels x QPs | ECMP busbw p10 / median / p90 (Gb/s) | ours (Gb/s) | speedup "
            "over ECMP median |",
            "|---|---|---|---|",
        ]
        for e in traffic["ecmp_settings"]:
            lines.append(
                f"| {e['channels']}x{e['qps_per_connection']} | {e['ecmp_busbw_gbps_p10']} / "
                f"{e['ecmp_busbw_gbps_median']} / {e['ecmp_busbw_gbps_p90']} | "
                f"{e['ours_busbw_gbps']} | {e['speedup_vs_ecmp_median']}x |"
            )
        lines += ["", f"Model: {traffic.get('model', '')}."]
    out = RESULTS / "REPORT.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="full runs instead of --quick")
    ap.add_argument("--only", nargs="+", choices=BENCHES, help="run these benches only")
    ap.add_argument("--report-only", action="store_true", help="rebuild from existing JSON")
    ap.add_argument("--note", default="", help="a sentence added to the report's preamble")
    args = ap.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    names = list(args.only or BENCHES)
    failed = []
    if not args.report_only:
        for name in names:
            print(f"== bench.{name}", flush=True)
            res = run_bench(name, quick=not args.full)
            if res.get("_failed"):
                failed.append(name)
                print(f"   failed: see {RESULTS / (name + '.log')}", flush=True)
    mode = "full runs" if args.full else "`--quick` runs"
    note = (
        f"These are {mode} on a shared machine (other jobs ran at the same time), so "
        "measured times are upper bounds of what a quiet machine gives."
    ) + (f" {args.note}" if args.note else "")
    out = write_report(list(BENCHES), note)
    print(f"wrote {out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
