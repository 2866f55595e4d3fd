"""The largest oversubscription a control scheme sustains within its service limits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from power.simulate import SimConfig, SimResult, simulate
from power.traces import Trace


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    hp_loss_pct: float = 1.0
    lp_loss_pct: float = 2.0
    brake_events: int = 0
    violation_s: float = 0.0

    def ok(self, r: SimResult) -> bool:
        return (
            r.hp_throughput_loss_pct <= self.hp_loss_pct
            and r.lp_throughput_loss_pct <= self.lp_loss_pct
            and r.brake_events <= self.brake_events
            and r.budget_violation_s <= self.violation_s
        )


def max_extra_servers(
    trace: Trace,
    cfg: SimConfig | Callable[[int], SimConfig],
    *,
    limits: Limits | None = None,
    upper: int | None = None,
) -> tuple[int, SimResult]:
    """Binary search for the most extra servers that stay within ``limits``.

    ``cfg`` may be a function of the extra-server count, for thresholds derived from the
    row being simulated. Assumes that adding servers never helps (more servers, more
    capping), which the simulator's tests check; returns the run at the answer.
    """
    lim = limits or Limits()

    def config(extra: int) -> SimConfig:
        if callable(cfg):
            return dataclasses.replace(cfg(extra), extra_servers=extra)
        return dataclasses.replace(cfg, extra_servers=extra)

    hi = upper if upper is not None else config(0).base_servers
    cache: dict[int, SimResult] = {}

    def run(extra: int) -> SimResult:
        if extra not in cache:
            cache[extra] = simulate(trace, config(extra))
        return cache[extra]

    lo = 0
    if not lim.ok(run(0)):
        return 0, run(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lim.ok(run(mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo, run(lo)
