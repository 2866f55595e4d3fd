"""Power oversubscription scored on held-out rows of another shape than the training set.

Every scheme's parameters are fixed on the *training set* (the default generator's
inference row, the day ``bench.power`` derives thresholds from): its thresholds, and the
number of extra servers an operator would deploy (the most that kept the limits there).
The *held-out set* is three rows the parameters never saw, drawn from other distributions:

- ``bursty``: user surges twice as large and three times as frequent, a broader daily peak;
- ``job mix``: 40% of the row's servers run training jobs (synchronized swings), and only
  30% of the inference servers are low priority;
- ``training swings``: a training row with the inference row's headroom, whose jobs span
  24 servers each, so a whole job's power dips and returns at once.

Per scheme and held-out row: high/low-priority throughput loss, brake events and seconds
over budget at the extra servers chosen on the training set (does the choice generalize?),
and the most extra servers the held-out row tolerates with the scheme's parameters fixed
(the scoring only searches the server count; thresholds are never re-derived there).

Baselines beside ours: no oversubscription (0 extra), static per-server caps (every server
capped at its even share of the row budget, the no-controller way to oversubscribe safely),
and POLCA's published thresholds (T1 80%, T2 89%) with POLCA's 40 s out-of-band actuation.
Everything here is *simulated* (``power.simulate``); only the actuation latency fed to the
in-band schemes is measured (``bench.power_actuation``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from power.config import PolicyConfig, WorkloadKind
from power.derive import derive_thresholds
from power.generate import SERVER_PROVISIONED_W, GeneratorConfig, generate
from power.search import Limits, max_extra_servers
from power.simulate import Control, SimConfig, SimResult, _Replay, simulate, uncapped_row_w
from power.traces import Trace

BASE = 40
UPPER = 32
OOB_LATENCY_S = 40.0
TICK_S = 1.0
POLCA_PUBLISHED = PolicyConfig(escalate_after_s=OOB_LATENCY_S + TICK_S, min_hold_s=60.0)
"""POLCA's thresholds (``PolicyConfig``'s defaults: T1 80%, T2 89%) at its 40 s path."""

OTHER_PEAK_W = 1010.0
"""A server's non-GPU power at its peak (the generator's 900 W + 80 W busy + 3 sigma noise):
what a static cap must leave for the rest of the server."""

OURS = "trainguard (derived thresholds, measured in-band latency)"
NONE = "no oversubscription"
STATIC = "static per-server caps"
POLCA = "POLCA published thresholds (T1 80%, T2 89%, 40 s out-of-band)"


class _StaticCaps(_Replay):
    """The simulator's physics with every server's GPUs held at a fixed power limit from
    the first second, and no controller: the static way to fit more servers in a budget."""

    def __init__(self, trace: Trace, cfg: SimConfig, cap_w: float) -> None:
        super().__init__(trace, cfg)
        self.limit_w[:] = max(cap_w, self.pl_min_w)


def static_cap_w(extra: int) -> float:
    """GPU power per server when the row's budget is split evenly, minus the rest of the
    server at its peak: the cap an operator sets without any telemetry."""
    return BASE * SERVER_PROVISIONED_W / (BASE + extra) - OTHER_PEAK_W


def simulate_static(trace: Trace, cfg: SimConfig) -> SimResult:
    return _StaticCaps(trace, cfg, static_cap_w(cfg.extra_servers)).run()


def _search(
    trace: Trace, cfg: Callable[[int], SimConfig], *, static: bool
) -> tuple[int, SimResult]:
    """Most extra servers within the limits (binary search, as ``power.search``)."""
    if not static:
        return max_extra_servers(trace, cfg, limits=Limits(), upper=UPPER)
    lim = Limits()
    lo, hi = 0, UPPER
    best = simulate_static(trace, cfg(0))
    if not lim.ok(best):
        return 0, best
    while lo < hi:
        mid = (lo + hi + 1) // 2
        r = simulate_static(trace, replace(cfg(mid), extra_servers=mid))
        if lim.ok(r):
            lo, best = mid, r
        else:
            hi = mid - 1
    return lo, best


@dataclass(slots=True)
class Scheme:
    name: str
    config: Callable[[int], SimConfig]
    static: bool = False
    fixed_extra: int | None = None
    """Deploys this many extra servers whatever the training set allows (no oversubscription)."""

    def run(self, trace: Trace, extra: int) -> SimResult:
        cfg = replace(self.config(extra), extra_servers=extra)
        return simulate_static(trace, cfg) if self.static else simulate(trace, cfg)

    def search(self, trace: Trace) -> tuple[int, SimResult]:
        if self.fixed_extra is not None:
            return self.fixed_extra, self.run(trace, self.fixed_extra)
        return _search(trace, self.config, static=self.static)


def schemes(train_trace: Trace, latency_s: float) -> list[Scheme]:
    """The schemes; ours derives its thresholds from ``train_trace`` only."""
    inband = SimConfig(base_servers=BASE, actuation_latency_s=latency_s, tick_interval_s=TICK_S)

    def ours(extra: int) -> SimConfig:
        d = derive_thresholds(
            uncapped_row_w(train_trace, BASE + extra),
            BASE * SERVER_PROVISIONED_W,
            step_s=train_trace.step_s,
            actuation_latency_s=latency_s,
            tick_interval_s=TICK_S,
        )
        return replace(inband, policy=d.apply(PolicyConfig()))

    return [
        Scheme(OURS, ours),
        Scheme(NONE, lambda _e: replace(inband, control=Control.NONE), fixed_extra=0),
        Scheme(STATIC, lambda _e: replace(inband, control=Control.NONE), static=True),
        Scheme(
            POLCA,
            lambda _e: replace(inband, policy=POLCA_PUBLISHED, actuation_latency_s=OOB_LATENCY_S),
        ),
    ]


def _renamed(trace: Trace, prefix: str) -> list[Any]:
    return [dataclasses.replace(s, name=f"{prefix}-{i:03d}") for i, s in enumerate(trace.servers)]


def heldout_traces(*, seed: int, duration_s: float) -> dict[str, Trace]:
    """Rows of other shapes than the training set, from seeds the training set never used."""
    servers = BASE + UPPER

    def gen(**kw: Any) -> Trace:
        return generate(GeneratorConfig(duration_s=duration_s, period_s=duration_s, **kw))

    bursty = gen(
        kind=WorkloadKind.INFERENCE,
        servers=servers,
        seed=seed + 2000,
        surge_max=0.25,
        surge_every_s=300.0,
        peak_sharpness=16.0,
    )
    n_train = (2 * servers) // 5
    inf = gen(
        kind=WorkloadKind.INFERENCE,
        servers=servers - n_train,
        seed=seed + 3000,
        low_priority_frac=0.3,
    )
    train = gen(kind=WorkloadKind.TRAINING, servers=n_train, seed=seed + 3001, peak_frac=0.79)
    # Interleave so every prefix of the row (the simulator takes the first N) keeps the mix.
    a, b = _renamed(inf, "inf"), _renamed(train, "trn")
    mixed: list[Any] = []
    while a or b:
        mixed += [a.pop(0)] if a else []
        mixed += [a.pop(0)] if a else []
        mixed += [b.pop(0)] if b else []
    mix = Trace(step_s=inf.step_s, start_s=0.0, servers=mixed)
    swings = gen(
        kind=WorkloadKind.TRAINING,
        servers=servers,
        seed=seed + 4000,
        peak_frac=0.79,
        job_servers=24,
    )
    return {"bursty": bursty, "job mix": mix, "training swings": swings}


def _figures(res: SimResult) -> dict[str, Any]:
    return {
        "hp_loss_pct": round(res.hp_throughput_loss_pct, 3),
        "lp_loss_pct": round(res.lp_throughput_loss_pct, 3),
        "brake_events": res.brake_events,
        "violation_s": res.budget_violation_s,
        "limits_met": Limits().ok(res),
    }


def evaluate(
    train_trace: Trace, heldout: dict[str, Trace], latency_s: float
) -> list[dict[str, Any]]:
    """Per scheme: the extra servers chosen on the training set, and on each held-out row
    the figures at that choice and the most the row tolerates with the same parameters."""
    out = []
    for sc in schemes(train_trace, latency_s):
        chosen, train_res = sc.search(train_trace)
        rows: dict[str, Any] = {}
        for name, trace in heldout.items():
            at = sc.run(trace, chosen)
            best, best_res = sc.search(trace)
            rows[name] = {
                "at_chosen": _figures(at),
                "max_extra_servers_pct": 100.0 * best / BASE,
                "at_max": _figures(best_res),
            }
        out.append(
            {
                "name": sc.name,
                "chosen_extra_servers_pct": 100.0 * chosen / BASE,
                "training": _figures(train_res),
                "heldout_rows": rows,
                # Headline figures: the worst held-out row.
                "heldout_extra_servers_pct": min(r["max_extra_servers_pct"] for r in rows.values()),
                "heldout_hp_loss_pct": max(r["at_chosen"]["hp_loss_pct"] for r in rows.values()),
                "heldout_limits_met_at_chosen": all(
                    r["at_chosen"]["limits_met"] for r in rows.values()
                ),
            }
        )
    return out


class _Recording(_Replay):
    """The simulator, keeping the row's power at every tick it runs. Between ticks it
    jumps only over stretches where nothing is capped, where power is the uncapped row's."""

    def __init__(self, trace: Trace, cfg: SimConfig) -> None:
        super().__init__(trace, cfg)
        self.frac = self.row_uncapped.copy()

    def _tick(self, k: int, row: float, frac: float, p_eff: Any) -> None:
        self.frac[k] = frac
        super()._tick(k, row, frac, p_eff)


def power_timeline(trace: Trace, cfg: SimConfig) -> dict[str, list[float]]:
    """Row power over time (budget = 1.0), uncapped and under ``cfg``, for the report."""
    rec = _Recording(trace, cfg)
    rec.run()
    step = max(1, rec.n // 600)
    return {
        "t_s": [float(x) for x in np.arange(0, rec.n, step) * trace.step_s],
        "uncapped_frac": [round(float(x), 4) for x in rec.row_uncapped[::step]],
        "controlled_frac": [round(float(x), 4) for x in rec.frac[::step]],
    }
