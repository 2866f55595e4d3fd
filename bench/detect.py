"""Detection scenario matrix: is every fault found, is the right culprit named, how fast?

An 8-rank job (4 nodes x 2 ranks) is simulated step by step on a virtual clock: per-rank
compute with random jitter, synchronous collectives (everyone waits for the slowest rank),
step summaries reaching the controller a report interval later, in-flight records from
the ranks' watchdogs while a call is stuck (re-sent every second), rank exits, and a link
probe round when the detectors ask for one. The records go through the controller's real
detectors (``controller.logic.detection.c4d``), ticked once a simulated second, exactly as in
the controller loop; only time is simulated, so thousands of steps take seconds.

Scenarios: healthy (long, 20% jitter), stragglers at 10/20/50%, a hang before a
collective, a crash (with its collateral exits), a rank killed from outside (SIGKILL: no
exit record; its agent reports it vanished a moment after its peers' collateral exits), a
slow link, two stragglers at once, a straggler from thermal throttling (its cause read off
the GPU sample), and a NaN gradient on one rank (spread by the all_reduce to every rank
from the next step on). Each node's agent reports on its own 5 s timer with its own phase,
so one step's summaries reach the controller seconds apart.

Then the fleet-shaped set (``bench.detect_fleet``, issue 16): pipeline and MoE jobs that
must raise nothing, heavy-tailed noise, a flapping node, many culprits in 32-128 rank jobs,
a straggler inside a pipeline stage, a hang whose waiting node goes quiet; a development
set and a held-out set from other distributions, with a plain per-rank threshold detector
measured in the same runs (``baselines``). These are simulated; beside them, ``gloo`` holds
the same figures from real 8-rank gloo runs (``bench.detect_gloo``: a DeviceMesh pipeline,
MoE experts with uneven all-to-all, TP groups of two sizes, a slowed middle-stage rank),
whose measured step summaries are replayed to the detectors on simulated report timers
(skipped with --no-gloo). With the gloo runs, the top-level ``pp_false_positives`` and
``moe_false_positives`` pool both, and ``role_straggler_detect_steps_p50`` is the gloo runs'
own: the job's steps from the fault until the incident opened, with the agents' report
cadence and the controller's tick at their defaults (the generator's figures under
``sim``). The real-process path is covered by tests/e2e/test_detection_e2e.py; the
wrapper's overhead next to plain torch.distributed comes from bench.collectives in the
same run (skipped with --no-overhead).

    python -m bench.detect [--quick] [--json] [--no-overhead] [--no-gloo]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from bench.detect_baselines import baseline_figures
from bench.detect_fleet import fleet_results, print_fleet
from controller.logic.detection.c4d import C4DConfig, Finding, FindingKind, JobTrackers
from controller.logic.detection.cause import straggler_cause
from trainguard.wire import (
    GpuSample,
    InflightCollective,
    JobRecords,
    ProbeResult,
    RankEvent,
    StepSummary,
    ThrottleReason,
)

WORLD = 8
PER_NODE = 2
JOB = "bench"
COMPUTE_S = 1.0
COMM_S = 0.1
#: Agents batch job records into reports every 5 s (their default), so a step summary
#: reaches the controller 0-5 s after the step; urgent records (stuck calls, exits) go out
#: at once.
REPORT_INTERVAL_S = 5.0
URGENT_LATENCY_S = 0.3
#: The ranks' watchdog reports a call stuck for max(5 x median, 2 s), then every second.
WATCHDOG_S = 2.0
#: Sim time between a probe request and its results (the controller schedules probes ~15 s
#: of training ahead so every rank receives the command first).
PROBE_LEAD_S = 15.0
FAULT_STEP = 60


def node_of(rank: int) -> str:
    return f"node-{rank // PER_NODE}"


@dataclass
class Scenario:
    name: str
    culprit: tuple[int, ...]
    kinds: tuple[FindingKind, ...]
    slow: dict[int, float] = field(default_factory=dict)
    hang_rank: int | None = None
    crash_rank: int | None = None
    slow_link: tuple[int, int] | None = None
    thermal_rank: int | None = None
    killed: bool = False
    """With ``crash_rank``: killed from outside (no exit record; the agent reports it)."""
    nan_rank: int | None = None
    jitter: float = 0.05
    steps: int = 400


@dataclass
class Outcome:
    detected: bool
    named: tuple[int, ...]
    correct: bool
    detect_s: float | None
    detect_steps: int | None
    extra: list[str]
    cause: str = ""


def run(sc: Scenario, seed: int) -> Outcome:
    rng = random.Random(seed)
    trackers = JobTrackers(C4DConfig())
    inbox: list[tuple[float, str, JobRecords]] = []
    findings: list[tuple[float, int, Finding]] = []
    t, step, next_tick = 0.0, 0, 1.0
    fault_t: float | None = None
    stuck_since: float | None = None
    probe_due: tuple[float, tuple[tuple[int, int], ...]] | None = None
    # Every node's agent reports on its own timer: phases drawn independently per node.
    phase = {node_of(r): rng.uniform(0, REPORT_INTERVAL_S) for r in range(WORLD)}

    def deliver(until: float) -> None:
        nonlocal next_tick, probe_due
        while next_tick <= until:
            for item in [i for i in inbox if i[0] <= next_tick]:
                inbox.remove(item)
                trackers.observe(item[1], item[2], next_tick)
            for f in trackers.evaluate(next_tick):
                findings.append((next_tick, step, f))
                if f.probe_pairs and not f.resolved and probe_due is None:
                    probe_due = (next_tick + PROBE_LEAD_S, f.probe_pairs)
            if probe_due and probe_due[0] <= next_tick:
                probe_results(trackers, probe_due[1], sc.slow_link)
                probe_due = None
                verdict = trackers.jobs[JOB].finish_probe("p")
                if verdict is not None:
                    findings.append((next_tick, step, verdict))
            next_tick += 1.0

    while step < sc.steps:
        faulty = step >= FAULT_STEP
        if faulty and fault_t is None:
            fault_t = t
        if faulty and sc.crash_rank is not None:
            crash(inbox, t, sc.crash_rank, killed=sc.killed)
            deliver(t + 30)
            break
        compute = {}
        for r in range(WORLD):
            c = COMPUTE_S * (1 + rng.uniform(-sc.jitter, sc.jitter))
            if faulty:
                c *= 1 + sc.slow.get(r, 0.0)
            compute[r] = c
        comm = COMM_S * (1 + rng.uniform(-sc.jitter, sc.jitter))
        if faulty and sc.slow_link:
            comm += 0.3
        if faulty and sc.hang_rank is not None:
            stuck_since = t + max(c for r, c in compute.items() if r != sc.hang_rank)
            hang(inbox, deliver, stuck_since, step, sc.hang_rank)
            break
        slowest = max(compute.values())
        end = t + slowest + comm
        for r, c in compute.items():
            first = phase[node_of(r)]
            arrive = first + REPORT_INTERVAL_S * max(
                0, math.ceil((end - first) / REPORT_INTERVAL_S)
            )
            nan = nonfinite_fields(sc.nan_rank, r, step) if faulty else {}
            rec = StepSummary(
                job=JOB,
                rank=r,
                world_size=WORLD,
                step=step,
                step_time_s=end - t,
                compute_time_s=c,
                collective_wait_s=slowest - c + comm,
                gpu_index=r % PER_NODE,
                **nan,
            )
            inbox.append((arrive, node_of(r), JobRecords(steps=[rec])))
        t = end
        step += 1
        deliver(t)
    deliver(t + REPORT_INTERVAL_S + 2 + (PROBE_LEAD_S + 3 if sc.slow_link else 0))
    return judge(sc, findings, fault_t, FAULT_STEP)


def nonfinite_fields(nan_rank: int | None, rank: int, step: int) -> dict[str, Any]:
    """A NaN gradient on ``nan_rank`` at the fault step; every rank's from the next step on.

    Four reductions per step: the poisoned one is the step's second; once the optimizer has
    applied the reduced NaN, every rank's first reduction of each later step carries it.
    """
    if nan_rank is None:
        return {}
    if step == FAULT_STEP:
        if rank != nan_rank:
            return {}
        seq, calls = step * 4 + 2, 1
    else:
        seq, calls = step * 4 + 1, 4
    return {
        "nonfinite_inputs": calls,
        "nonfinite_first_op": "all_reduce",
        "nonfinite_first_group": "world",
        "nonfinite_first_seq": seq,
    }


def crash(
    inbox: list[tuple[float, str, JobRecords]], t: float, rank: int, *, killed: bool = False
) -> None:
    for r in range(WORLD):
        primary = r == rank
        ev = RankEvent(
            job=JOB,
            rank=r,
            kind="exited",
            exit_code=None if primary and killed else 7 if primary else 1,
            time_unix_s=t,
            world_size=WORLD,
            collective_failed=not primary,
            disconnected=primary and killed,
            error="" if primary else "RuntimeError: Connection closed by peer",
        )
        # Survivors' collectives fail a moment later, and their agents may report first; a
        # killed rank's agent reports it only after its vanish grace (1 s).
        delay = URGENT_LATENCY_S + (0.5 if primary else 0.2) + (1.0 if primary and killed else 0)
        inbox.append((t + delay, node_of(r), JobRecords(rank_events=[ev])))


def hang(
    inbox: list[tuple[float, str, JobRecords]], deliver: Any, since: float, step: int, rank: int
) -> None:
    """Every rank but ``rank`` enters all_reduce #seq and waits; watchdogs report it."""
    seq = (step + 1) * 4
    t = since + WATCHDOG_S
    while t < since + 40:
        for r in range(WORLD):
            if r == rank:
                continue
            rec = InflightCollective(
                job=JOB,
                rank=r,
                group="world",
                op="all_reduce",
                seq=seq,
                elapsed_s=t - since,
                group_ranks=list(range(WORLD)),
                last_completed_seq={"world": seq - 1},
                step=step,
            )
            inbox.append((t + URGENT_LATENCY_S, node_of(r), JobRecords(inflight=[rec])))
        t += 1.0
    deliver(since + 40)


def probe_results(
    trackers: JobTrackers, pairs: tuple[tuple[int, int], ...], slow_link: tuple[int, int] | None
) -> None:
    size = 8 << 20
    for a, b in pairs:
        gbps = 10.0 if slow_link and {a, b} == set(slow_link) else 100.0
        trackers.tracker(JOB).observe_probe(
            ProbeResult(
                job=JOB,
                probe_id="p",
                src_rank=a,
                dst_rank=b,
                size_bytes=size,
                duration_s=size * 8 / (gbps * 1e9),
            )
        )


def judge(
    sc: Scenario, found: list[tuple[float, int, Finding]], fault_t: float | None, fault_step: int
) -> Outcome:
    opened = [(t, s, f) for t, s, f in found if not (f.resolved or f.refresh)]
    hits = [(t, s, f) for t, s, f in opened if f.kind in sc.kinds]
    named = tuple(sorted({r for _, _, f in hits for r in f.ranks}))
    # comm_slow is the first half of a slow-link finding (it orders the probe); anywhere
    # else it is a false alarm like any other.
    extra = [
        f"{f.kind}:{list(f.ranks)}"
        for _, _, f in opened
        if f.kind not in sc.kinds
        and not (f.kind is FindingKind.COMM_SLOW and sc.slow_link is not None)
    ]
    if not sc.culprit:
        return Outcome(
            not opened,
            (),
            not opened,
            None,
            None,
            [f"{f.kind}:{list(f.ranks)}" for _, _, f in opened],
        )
    if not hits or fault_t is None:
        return Outcome(False, (), False, None, None, extra)
    last_t, last_step, _ = max(hits, key=lambda h: h[0])
    cause = ""
    if sc.thermal_rank is not None:
        hot = GpuSample(
            index=0,
            sm_clock_mhz=1350,
            temperature_c=90.0,
            throttle_reasons=[ThrottleReason.HW_THERMAL_SLOWDOWN],
        )
        cause = ", ".join(straggler_cause(hot, [GpuSample(index=0, sm_clock_mhz=1980)])[0])
    correct = named == tuple(sorted(sc.culprit)) and not extra
    return Outcome(
        True, named, correct, last_t - fault_t, max(0, last_step - fault_step), extra, cause
    )


SCENARIOS = [
    Scenario("straggler 10%", (3,), (FindingKind.STRAGGLER,), slow={3: 0.10}),
    Scenario("straggler 20%", (5,), (FindingKind.STRAGGLER,), slow={5: 0.20}),
    Scenario("straggler 50%", (0,), (FindingKind.STRAGGLER,), slow={0: 0.50}),
    Scenario("hang before all_reduce", (6,), (FindingKind.HANG,), hang_rank=6),
    Scenario("crash (exit 7)", (2,), (FindingKind.RANK_CRASH,), crash_rank=2),
    Scenario("killed (SIGKILL)", (5,), (FindingKind.RANK_CRASH,), crash_rank=5, killed=True),
    Scenario("slow link 2<->3", (2, 3), (FindingKind.SLOW_LINK,), slow_link=(2, 3)),
    Scenario("two stragglers", (1, 6), (FindingKind.STRAGGLER,), slow={1: 0.2, 6: 0.2}),
    Scenario(
        "thermal straggler 15%", (4,), (FindingKind.STRAGGLER,), slow={4: 0.15}, thermal_rank=4
    ),
    Scenario("nan gradient", (7,), (FindingKind.NONFINITE,), nan_rank=7),
]


def cost(world: int, steps: int = 30) -> dict[str, float]:
    """Detector cost per step record against pydantic parsing of the same records."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(list[StepSummary])
    payloads = [
        json.dumps(
            [
                {
                    "job": JOB,
                    "rank": r,
                    "world_size": world,
                    "step": s,
                    "step_time_s": 1.1,
                    "compute_time_s": 1.0 + (r % 7) * 0.002,
                    "collective_wait_s": 0.1,
                    "gpu_index": 0,
                }
                for r in range(world)
            ]
        ).encode()
        for s in range(steps)
    ]
    t0 = time.perf_counter()
    parsed = [adapter.validate_json(p) for p in payloads]
    parse_s = time.perf_counter() - t0
    trackers = JobTrackers()
    t0 = time.perf_counter()
    for s, rows in enumerate(parsed):
        for first in range(0, world, 8):
            trackers.observe(f"n{first // 8}", JobRecords(steps=rows[first : first + 8]), s)
        trackers.evaluate(float(s))
    detect_s = time.perf_counter() - t0
    n = world * steps
    return {
        "ranks": world,
        "parse_us_per_record": round(parse_s / n * 1e6, 2),
        "detect_us_per_record": round(detect_s / n * 1e6, 2),
        "detect_ms_per_step": round(detect_s / steps * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer healthy steps and seeds")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--no-overhead", action="store_true", help="skip the 2-rank gloo run")
    ap.add_argument("--no-gloo", action="store_true", help="skip the 8-rank gloo role runs")
    args = ap.parse_args()
    seeds = [1, 2] if args.quick else [1, 2, 3, 4, 5]
    healthy_steps = 5000 if args.quick else 20000

    rows: list[dict[str, Any]] = []
    healthy = Scenario("healthy, 20% jitter", (), (), jitter=0.2, steps=healthy_steps)
    h = run(healthy, 99)
    fp = len(h.extra)
    rows.append(
        {
            "scenario": healthy.name,
            "detected": "-",
            "true": "-",
            "named": "-",
            "correct": h.correct,
            "detect_s": None,
            "detect_steps": None,
            "note": f"{fp} false positives in {healthy_steps} steps",
        }
    )
    hang_s: list[float] = []
    all_detect_s: list[float] = []
    straggler_steps: list[int] = []
    correct = total = 0
    for sc in SCENARIOS:
        outs = [run(sc, seed) for seed in seeds]
        total += len(outs)
        correct += sum(o.correct for o in outs)
        times = [o.detect_s for o in outs if o.detect_s is not None]
        steps = [o.detect_steps for o in outs if o.detect_steps is not None]
        all_detect_s += times
        if sc.hang_rank is not None:
            hang_s += times
        if FindingKind.STRAGGLER in sc.kinds:
            straggler_steps += steps
        rows.append(
            {
                "scenario": sc.name,
                "detected": f"{sum(o.detected for o in outs)}/{len(outs)}",
                "true": list(sc.culprit),
                "named": sorted({r for o in outs for r in o.named}),
                "correct": all(o.correct for o in outs),
                "detect_s": round(statistics.median(times), 1) if times else None,
                "detect_steps": int(statistics.median(steps)) if steps else None,
                "note": "; ".join(
                    sorted({e for o in outs for e in o.extra} | {o.cause for o in outs if o.cause})
                ),
            }
        )
    costs = [cost(w) for w in ([256, 2048] if args.quick else [256, 2048, 16384])]
    fleet = fleet_results(args.quick)
    if not args.no_gloo:
        from bench.detect_gloo import gloo_results

        gloo = gloo_results(args.quick)
        fleet["baselines"][0]["gloo"] = gloo.pop("baseline")
        fleet["gloo"] = gloo
        pool_gloo(fleet, gloo)
    # PyTorch as it ships, and its Flight Recorder's culprit, on the same scenario matrix.
    for flight in (False, True):
        fleet["baselines"].append(
            baseline_figures(SCENARIOS, len(seeds), WORLD, healthy_steps, flight=flight)
        )
    if not args.no_gloo:
        # The same two baselines measured: real gloo runs with nobody watching, one per
        # fault, real Flight Recorder dumps (bench/detect_baselines_gloo.py).
        from bench.detect_baselines_gloo import measured_baselines

        measured = measured_baselines()
        fleet["baselines"][-2]["gloo"] = measured["pytorch"]
        fleet["baselines"][-1]["gloo"] = measured["flight"]
    overhead: dict[str, Any] = {}
    if not args.no_overhead:
        from bench.collectives import measure

        overhead = measure(quick=True)

    print(
        f"{'SCENARIO':<24} {'DETECTED':>8} {'TRUE':>8} {'NAMED':>8} {'OK':>3} "
        f"{'DETECT_S':>8} {'STEPS':>5}  NOTE"
    )
    for r in rows:
        print(
            f"{r['scenario']:<24} {r['detected']:>8} {r['true']!s:>8} {r['named']!s:>8} "
            f"{'yes' if r['correct'] else 'NO':>3} {_num(r['detect_s']):>8} "
            f"{_num(r['detect_steps']):>5}  {r['note']}"
        )
    if overhead:
        print(
            f"wrapper overhead: {overhead['overhead_us_per_call_1rank']} us/call over plain "
            f"{overhead['plain_us_per_call_1rank']} us/call all_reduce "
            "(1-rank gloo on one CPU, interleaved);"
            f" {overhead['overhead_us_per_call']} us/call with 2 ranks on 2 cores"
        )
    print(f"{'RANKS':>7} {'PARSE_US/REC':>13} {'DETECT_US/REC':>14} {'DETECT_MS/STEP':>15}")
    for c in costs:
        print(
            f"{c['ranks']:>7} {c['parse_us_per_record']:>13} {c['detect_us_per_record']:>14} "
            f"{c['detect_ms_per_step']:>15}"
        )
    print(
        "\nBaselines on the same scenario matrix (derived: documented default timeouts; "
        "Flight Recorder culprit from the real analysis):"
    )
    print(f"{'SCENARIO':<24} " + " ".join(f"{b['name']:>34}" for b in fleet["baselines"][1:]))
    for i, sc in enumerate(SCENARIOS):
        cells = []
        for b in fleet["baselines"][1:]:
            row = b["scenarios"][i]
            when = "never" if row["detect_s"] is None else f"{row['detect_s']}s"
            cells.append(f"{row['detected']} {row['named']!s} {when}")
        print(f"{sc.name:<24} " + " ".join(f"{c:>34}" for c in cells))
    for b in fleet["baselines"][1:]:
        print(
            f"{b['name']}: localization accuracy {b['localization_accuracy']}, hang noticed "
            f"after {b['hang_detect_s_p50']} s, stragglers never"
        )
        if "gloo" in b:
            g = b["gloo"]
            print(
                f"  measured on real gloo runs ({g['how']}): detected {g['detected']}, "
                f"localization accuracy {g['localization_accuracy']}, hang noticed after "
                f"{g['hang_detect_s_p50']} s ({g['hang_detect_s_p50_at_nccl_default']} s at "
                f"NCCL's default), false positives/1k steps {g['false_positives_per_1k_steps']}"
            )
    print_fleet(fleet)
    if "gloo" in fleet:
        print(f"real gloo runs (8 ranks): {json.dumps(fleet['gloo'])}")
        print(f"  baseline on the same runs: {json.dumps(fleet['baselines'][0]['gloo'])}")
    result = {
        **fleet,
        "detect_cost": costs,
        "localization_accuracy": round(correct / total, 3),
        "false_positives_per_1k_steps": round(1000 * fp / healthy_steps, 3),
        "healthy_steps": healthy_steps,
        "hang_detect_s_p50": round(statistics.median(hang_s), 2) if hang_s else None,
        "straggler_detect_steps_p50": (
            statistics.median(straggler_steps) if straggler_steps else None
        ),
        # Per-call cost on a 1-rank gloo group pinned to one CPU (interleaved blocks): the
        # wrapper's cost without the scheduling noise of two ranks sharing two cores or of
        # cross-core hand-offs to gloo's thread; the 2-rank figure is reported beside it.
        "overhead_us_per_call": overhead.get("overhead_us_per_call_1rank"),
        "plain_us_per_call": overhead.get("plain_us_per_call_1rank"),
        "overhead_us_per_call_2ranks": overhead.get("overhead_us_per_call"),
        "scenarios": rows,
        "detect_s": all_detect_s,
    }
    print(
        f"localization accuracy {result['localization_accuracy']:.3f}, "
        f"{result['false_positives_per_1k_steps']} false positives per 1k healthy steps, "
        f"hang detected in {result['hang_detect_s_p50']} s (p50), "
        f"stragglers in {result['straggler_detect_steps_p50']} steps (p50)"
    )
    if args.json:
        print(json.dumps(result))


def pool_gloo(fleet: dict[str, Any], gloo: dict[str, Any]) -> None:
    """The issue-16 figures with the real gloo runs: false positives add up over the
    generator's development set and the gloo runs; the role straggler's figure is the gloo
    runs' own (the job's steps from the fault until the incident opened, agents and
    controller at their defaults), the generator's staying under ``sim``."""
    fleet["sim"] = {
        key: fleet[key]
        for key in (
            "pp_false_positives",
            "moe_false_positives",
            "role_straggler_detect_steps_p50",
            "role_straggler_data_steps_p50",
            "role_straggler_detected",
        )
    }
    for key in ("pp_false_positives", "moe_false_positives"):
        fleet[key] += gloo[key]
    for key in (
        "role_straggler_detect_steps",
        "role_straggler_detect_steps_p50",
        "role_straggler_data_steps_p50",
        "role_straggler_detected",
    ):
        fleet[key] = gloo[key]
    fleet["tp_mixed_false_positives"] = gloo["tp_mixed_false_positives"]


def _num(value: float | int | None) -> str:
    return "-" if value is None else str(value)


if __name__ == "__main__":
    main()
