"""Fleet-shaped detection figures (issue 16): roles, heavy tails, flapping, many culprits.

Two scenario sets run through :func:`bench.detect_sim.run_sim`:

* ``DEV``: the shapes and noise the detector was developed against (pipeline 4x4 with a
  30% slower last stage, MoE with 2x skew, Pareto spikes alpha 1.5 on 2% of rank-steps,
  32/64-rank jobs, agents on independent 5 s report phases);
* ``HELDOUT``: drawn from other distributions, never used to choose a parameter: deeper
  pipelines with a heavier first stage too, 3x MoE skew whose popular experts rotate, a
  heavier tail (alpha 1.1 on 4%) on 64 ranks, another flapping rhythm, 128-rank jobs and TP
  groups of two sizes, agents on 8 s timers with 1 s jitter.

In the same runs, a plain per-rank threshold detector (20% over the job median for 3
steps) sees every step complete and in order; its figures are the ``baselines`` entry.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from bench.detect_sim import Delivery, Layout, Noise, SimOutcome, SimScenario, run_sim
from controller.logic.detection.c4d import FindingKind
from controller.logic.detection.c4d.evidence import StragglerEvidence

BASELINE_NAME = "per-rank threshold: compute > 1.2 x job median for 3 consecutive steps"


@dataclass(kw_only=True)
class FleetSet:
    pp: SimScenario
    moe: SimScenario
    heavy: SimScenario
    flap: SimScenario
    multi: list[SimScenario] = field(default_factory=list)
    role_straggler: list[SimScenario] = field(default_factory=list)
    hang_quiet: SimScenario


def dev_set(quick: bool) -> FleetSet:
    d = Delivery(interval_s=5.0)
    pp = Layout(kind="pp", world=16, pp=4)
    return FleetSet(
        pp=SimScenario(name="pp 4x4, last stage +30%", layout=pp, delivery=d, steps=2000),
        moe=SimScenario(
            name="moe 16 experts, 2x skew", layout=Layout(kind="moe"), delivery=d, steps=2000
        ),
        heavy=SimScenario(
            name="heavy tail 32 ranks",
            layout=Layout(world=32, per_node=8),
            noise=Noise(jitter=0.1, spike_p=0.02, spike_alpha=1.5),
            delivery=d,
            steps=2000 if quick else 5000,
        ),
        flap=SimScenario(name="flapping 30/30", flap={5: (0.25, 30, 30)}, delivery=d, steps=700),
        multi=[
            SimScenario(
                name="32 ranks, 4 culprits",
                layout=Layout(world=32, per_node=8),
                slow={3: 0.10, 9: 0.15, 17: 0.25, 30: 0.40},
                delivery=d,
                steps=200,
            ),
            SimScenario(
                name="64 ranks, 6 culprits",
                layout=Layout(world=64, per_node=8),
                slow={1: 0.12, 14: 0.2, 15: 0.2, 33: 0.3, 47: 0.5, 62: 0.15},
                delivery=d,
                steps=200,
            ),
        ],
        role_straggler=[
            SimScenario(
                name="pp 4x4, stage-1 rank +15%", layout=pp, slow={6: 0.15}, delivery=d, steps=200
            )
        ],
        hang_quiet=SimScenario(
            name="hang, a waiting node goes quiet", layout=Layout(world=16), hang=(6, 2), delivery=d
        ),
    )


def heldout_set(quick: bool) -> FleetSet:
    d = Delivery(interval_s=8.0, send_jitter_s=1.0)
    pp = Layout(kind="pp", world=32, pp=8, last_stage_factor=1.5, first_stage_factor=1.15)
    noisy = Noise(jitter=0.1)
    return FleetSet(
        pp=SimScenario(name="pp 8x4", layout=pp, noise=noisy, delivery=d, steps=2000),
        moe=SimScenario(
            name="moe 32 experts, 3x skew, rotating",
            layout=Layout(kind="moe", world=32, per_node=8, moe_skew=3.0, moe_rotate_every=50),
            noise=Noise(jitter=0.08),
            delivery=d,
            steps=2000,
        ),
        heavy=SimScenario(
            name="heavier tail 64 ranks",
            layout=Layout(world=64, per_node=8),
            noise=Noise(jitter=0.15, spike_p=0.04, spike_alpha=1.1, spike_max=30.0),
            delivery=d,
            steps=1500 if quick else 4000,
        ),
        flap=SimScenario(
            name="flapping 15/45",
            layout=Layout(world=32, per_node=8),
            flap={20: (0.2, 15, 45)},
            delivery=d,
            steps=900,
        ),
        multi=[
            SimScenario(
                name="128 ranks, 8 culprits",
                layout=Layout(world=128, per_node=8),
                slow={5: 0.1, 6: 0.3, 40: 0.15, 41: 0.15, 77: 0.5, 90: 0.2, 101: 0.12, 127: 0.25},
                noise=noisy,
                delivery=d,
                steps=200,
            ),
            SimScenario(
                name="TP groups of 4 and 2, 3 culprits",
                layout=Layout(kind="tp_mixed", world=48, per_node=8),
                slow={2: 0.2, 30: 0.15, 44: 0.3},
                noise=noisy,
                delivery=d,
                steps=200,
            ),
        ],
        role_straggler=[
            SimScenario(
                name="pp 8x4, stage-3 rank +15%",
                layout=pp,
                slow={13: 0.15},
                noise=noisy,
                delivery=d,
                steps=200,
            ),
            SimScenario(
                name="moe 3x skew, expert +15%",
                layout=Layout(kind="moe", world=32, per_node=8, moe_skew=3.0),
                slow={21: 0.15},
                noise=Noise(jitter=0.08),
                delivery=d,
                steps=200,
            ),
        ],
        hang_quiet=SimScenario(
            name="hang, a waiting node goes quiet",
            layout=Layout(world=32, per_node=8),
            hang=(17, 1),
            delivery=d,
        ),
    )


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def measure(fleet: FleetSet, seeds: list[int]) -> dict[str, Any]:
    """trainguard's figures and the threshold baseline's, from the same runs."""
    tg: dict[str, Any] = {}
    base: dict[str, Any] = {"name": BASELINE_NAME}
    runs: dict[str, list[SimOutcome]] = {}

    def go(key: str, sc: SimScenario) -> list[SimOutcome]:
        out = [run_sim(sc, seed) for seed in seeds]
        runs.setdefault(key, []).extend(out)
        return out

    pp, moe, heavy = go("pp", fleet.pp), go("moe", fleet.moe), go("heavy", fleet.heavy)
    tg["pp_false_positives"] = sum(len(o.opened) for o in pp)
    base["pp_false_positives"] = sum(len(o.baseline_opened) for o in pp)
    tg["moe_false_positives"] = sum(len(o.opened) for o in moe)
    base["moe_false_positives"] = sum(len(o.baseline_opened) for o in moe)
    steps = sum(o.steps for o in heavy)
    tg["heavy_tail_false_positives_per_1k_steps"] = round(
        1000 * sum(len(o.opened) for o in heavy) / steps, 3
    )
    base["heavy_tail_false_positives_per_1k_steps"] = round(
        1000 * sum(len(o.baseline_opened) for o in heavy) / steps, 3
    )

    flapper = next(iter(fleet.flap.flap))
    flap = go("flap", fleet.flap)
    tg["flapping_incidents_per_flapping_node"] = statistics.mean(
        sum(1 for _, r in o.stragglers() if r == flapper) for o in flap
    )
    base["flapping_incidents_per_flapping_node"] = statistics.mean(
        sum(1 for _, r in o.baseline_opened if r == flapper) for o in flap
    )
    tg["flapping_flaps_recorded"] = [
        StragglerEvidence.model_validate(o.straggler_updates[-1].evidence).flaps
        if o.straggler_updates
        else 0
        for o in flap
    ]
    tg["flapping_other_incidents"] = sum(
        sum(1 for _, f in o.opened if f.ranks != (flapper,)) for o in flap
    )

    hits = base_hits = total = 0
    for sc in fleet.multi:
        for o in go("multi", sc):
            total += 1
            named = sorted(r for _, r in o.stragglers())
            hits += named == sorted(sc.culprits) and len(o.opened) == len(named)
            base_hits += sorted(r for _, r in o.baseline_opened) == sorted(sc.culprits)
    tg["multi_culprit_accuracy"] = round(hits / total, 3)
    base["multi_culprit_accuracy"] = round(base_hits / total, 3)

    delays: list[float] = []
    named_after: list[float] = []
    base_delays: list[float] = []
    found = base_found = total = 0
    for sc in fleet.role_straggler:
        (culprit,) = sc.culprits
        for o in go("role", sc):
            total += 1
            mine = [s for s, r in o.straggler_data_steps() if r == culprit]
            named_at = [s for s, r in o.stragglers() if r == culprit]
            # The baseline may have flagged the rank before the fault (a popular expert):
            # only an opening after it counts as finding the fault.
            theirs = [s for s, r in o.baseline_opened if r == culprit and s >= sc.fault_step]
            if mine and len(o.opened) == 1:
                found += 1
                delays.append(mine[0] - sc.fault_step)
                named_after.append(named_at[0] - sc.fault_step)
            if theirs:
                base_found += 1
                base_delays.append(theirs[0] - sc.fault_step)
    # The job's steps from the fault until the incident opened, delivery on the agents'
    # report timers included (the figure); the steps of data the verdict took
    # beside it (the baseline, fed every step complete and in order, has no delivery).
    tg["role_straggler_detect_steps_p50"] = _p50(named_after)
    tg["role_straggler_detect_steps"] = named_after
    tg["role_straggler_data_steps_p50"] = _p50(delays)
    tg["role_straggler_detected"] = round(found / total, 3)
    base["role_straggler_detect_steps_p50"] = _p50(base_delays)
    base["role_straggler_detected"] = round(base_found / total, 3)

    hang = go("hang", fleet.hang_quiet)
    tg["hang_quiet_agent_incidents"] = statistics.mean(len(o.opened) for o in hang)
    tg["hang_quiet_agent_correct"] = all(
        [(f.kind, f.ranks) for _, f in o.opened] == [(FindingKind.HANG, fleet.hang_quiet.culprits)]
        for o in hang
    )
    compared = [o for key in ("pp", "moe", "heavy", "flap") for o in runs[key]]
    tg["late_summary_steps_compared_pct"] = round(
        100 * sum(o.steps_compared for o in compared) / sum(o.steps for o in compared), 2
    )
    tg["scenarios"] = {
        key: sorted({sc.name for sc in _scenarios(fleet) if _kind(sc, fleet) == key})
        for key in runs
    }
    return {"trainguard": tg, "baseline": base}


def _scenarios(fleet: FleetSet) -> list[SimScenario]:
    return [
        fleet.pp,
        fleet.moe,
        fleet.heavy,
        fleet.flap,
        *fleet.multi,
        *fleet.role_straggler,
        fleet.hang_quiet,
    ]


def _kind(sc: SimScenario, fleet: FleetSet) -> str:
    for key, group in (
        ("pp", [fleet.pp]),
        ("moe", [fleet.moe]),
        ("heavy", [fleet.heavy]),
        ("flap", [fleet.flap]),
        ("multi", fleet.multi),
        ("role", fleet.role_straggler),
        ("hang", [fleet.hang_quiet]),
    ):
        if any(sc is other for other in group):
            return key
    return "?"


def fleet_results(quick: bool) -> dict[str, Any]:
    """The issue-16 keys for ``bench.detect --json``: dev figures at the top level,
    ``heldout`` beside them, and the threshold detector under ``baselines``."""
    seeds = [1, 2] if quick else [1, 2, 3, 4, 5]
    dev = measure(dev_set(quick), seeds)
    held = measure(heldout_set(quick), [s + 100 for s in seeds])
    return {
        **dev["trainguard"],
        "heldout": held["trainguard"],
        "baselines": [{**dev["baseline"], "heldout": held["baseline"]}],
        "fleet_seeds": len(seeds),
    }


def print_fleet(res: dict[str, Any]) -> None:
    keys = [
        "pp_false_positives",
        "moe_false_positives",
        "heavy_tail_false_positives_per_1k_steps",
        "flapping_incidents_per_flapping_node",
        "multi_culprit_accuracy",
        "role_straggler_detect_steps_p50",
        "role_straggler_detected",
    ]
    base = res["baselines"][0]
    print(f"{'FIGURE':<42} {'DEV':>8} {'HELDOUT':>8} {'BASELINE':>9} {'BASE-HELD':>9}")
    for k in keys:
        row = [res.get(k), res["heldout"].get(k), base.get(k), base["heldout"].get(k)]
        print(f"{k:<42} " + " ".join(f"{'-' if v is None else v!s:>8}" for v in row))
    print(
        f"flaps recorded {res['flapping_flaps_recorded']} (held out "
        f"{res['heldout']['flapping_flaps_recorded']}); hang with a quiet waiting node: "
        f"{res['hang_quiet_agent_incidents']} incident(s), correct "
        f"{res['hang_quiet_agent_correct']}; steps compared under independent report "
        f"phases {res['late_summary_steps_compared_pct']}%"
    )
