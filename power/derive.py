"""Thresholds from the actuation latency: the part of POLCA that in-band control improves.

POLCA set T2 = 89% because its out-of-band actuation took up to 40 s and the largest
inference spike within 40 s was 11.8%: a spike starting just below T2 must not reach 100%
before the cap lands. We apply the same rule to our own window (one telemetry tick plus the
measured command latency) and, one level down, to T1: each threshold leaves one window's
worst spike (plus a margin) of room below the next one.

    window = tick_interval_s + actuation_latency_s
    spike  = largest rise of the row's power within `window`, as a fraction of its budget
    T2     = 1 - spike - margin
    T1     = T2 - spike - margin

With a 41 s window and POLCA's 11.8% spike this gives T2 = 87% and T1 = 74% (POLCA chose
89% and 80%); with a 1-2 s in-band window the spike is a few percent and both rise by
about ten points, which is what lets more servers share the same budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from power.config import PolicyConfig
from power.errors import ConfigError
from power.traces import FloatArray


def max_rise_frac(row_w: FloatArray, budget_w: float, *, window_s: float, step_s: float) -> float:
    """Largest increase of ``row_w`` within ``window_s``, as a fraction of ``budget_w``."""
    if budget_w <= 0 or step_s <= 0 or window_s < 0:
        raise ConfigError("max_rise_frac: budget_w and step_s must be > 0, window_s >= 0")
    steps = max(1, math.ceil(window_s / step_s - 1e-9))
    if row_w.shape[0] <= steps:
        steps = row_w.shape[0] - 1
    if steps < 1:
        return 0.0
    win = sliding_window_view(row_w, steps + 1)
    rise = win.max(axis=1) - win[:, 0]
    return float(max(0.0, rise.max()) / budget_w)


@dataclass(kw_only=True, slots=True, frozen=True)
class DerivedThresholds:
    window_s: float
    spike_frac: float
    margin_frac: float
    t1_frac: float
    t2_frac: float
    escalate_after_s: float
    min_hold_s: float

    def apply(self, base: PolicyConfig) -> PolicyConfig:
        return dataclasses.replace(
            base,
            t1_frac=self.t1_frac,
            t2_frac=self.t2_frac,
            escalate_after_s=self.escalate_after_s,
            min_hold_s=self.min_hold_s,
        )


def derive_thresholds(
    row_w: FloatArray,
    budget_w: float,
    *,
    step_s: float,
    actuation_latency_s: float,
    tick_interval_s: float,
    margin_frac: float = 0.01,
    min_hold_floor_s: float = 15.0,
) -> DerivedThresholds:
    """T1/T2 (and the timings that go with them) for a row whose power history is ``row_w``.

    The hold time is 1.5 windows (never below ``min_hold_floor_s``) so a cap is not lifted
    before its effect has shown in two readings; escalation waits one window plus a tick.
    """
    window = tick_interval_s + actuation_latency_s
    spike = max_rise_frac(row_w, budget_w, window_s=window, step_s=step_s)
    t2 = min(0.99, 1.0 - spike - margin_frac)
    t1 = t2 - spike - margin_frac
    if t1 <= 0.3:
        raise ConfigError(
            f"derive: the row's spikes within {window:g}s reach {spike:.1%} of its budget; "
            "no threshold leaves room for them (shorten the actuation window)"
        )
    return DerivedThresholds(
        window_s=window,
        spike_frac=spike,
        margin_frac=margin_frac,
        t1_frac=round(t1, 4),
        t2_frac=round(t2, 4),
        escalate_after_s=window + tick_interval_s,
        min_hold_s=max(min_hold_floor_s, 1.5 * window),
    )


def polca_spike_check(t2_frac: float, spike_frac: float) -> bool:
    """POLCA's safety rule: T2 plus the largest spike within one window stays under 100%."""
    return bool(np.round(t2_frac + spike_frac, 9) < 1.0)
