"""Which knob caps a GPU, and what a clock cap means as a power limit.

Clocks first: a locked clock bounds power at once, while a power limit is enforced by the
GPU over a window and lets sub-second prefill spikes through (POLCA's finding). The power
limit takes over where clocks cannot be used, and every choice carries its reason.
"""

from __future__ import annotations

from power.clocks import MIN_CLOCK_FRACTION_OF_MAX, RANGE_FRACTIONS, ClockProfile
from power.config import Knob
from power.models import power_limit_for_clock
from power.tick_io import GpuStatus


def choose_knob(
    preferred: Knob,
    profile: ClockProfile | None,
    clocks_failed: str | None,
    limit_failed: str | None,
    model: str,
) -> tuple[Knob, str]:
    """The knob to use and, when it is not the preferred one, why."""
    clocks_ok = clocks_failed is None and profile is not None and profile.clocks_usable
    if preferred is Knob.CLOCKS:
        if clocks_ok:
            return Knob.CLOCKS, ""
        why = (
            f"clock lock failed ({clocks_failed})"
            if clocks_failed is not None
            else f"no clock range known for {model or 'unnamed GPU'}"
        )
        return Knob.POWER_LIMIT, f"power limit used: {why}"
    if limit_failed is None:
        return Knob.POWER_LIMIT, "power limit used: domain policy prefers it"
    if clocks_ok:
        return Knob.CLOCKS, f"clocks used: power limit failed ({limit_failed})"
    return Knob.POWER_LIMIT, "no usable knob"


def cap_fraction(profile: ClockProfile | None, cap_key: str) -> float:
    """The cap as a fraction of the GPU's highest clock: comparable across GPUs and knobs."""
    if profile is not None:
        return profile.caps_mhz[cap_key] / profile.max_mhz
    span = 1 - MIN_CLOCK_FRACTION_OF_MAX
    return MIN_CLOCK_FRACTION_OF_MAX + RANGE_FRACTIONS[cap_key] * span


def power_limit_for_cap(
    status: GpuStatus, profile: ClockProfile | None, frac: float, cap_key: str
) -> float | None:
    """The power limit standing in for a clock cap of ``frac`` (None: limits unknown).

    Reported limits win over the table's; without a reported minimum, a quarter of the
    maximum is assumed. The brake is the minimum limit. The result always lies within
    [minimum, maximum] as NVML enforces them, or the command would only fail: a table
    minimum above a reported maximum (a low-power part of a known family) gives way to
    the maximum, and rounding to 0.1 W never steps below the minimum or above the maximum.
    """
    tdp = status.power_limit_max_w or (profile.tdp_w if profile else None)
    lo = status.power_limit_min_w or (profile.power_limit_min_w if profile else None)
    if tdp is None:
        return None
    lo = min(lo, tdp) if lo is not None else 0.25 * tdp
    if cap_key == "brake":
        want = lo
    else:
        want = power_limit_for_clock(frac, tdp_w=tdp, limit_min_w=lo, kind=status.workload)
    return min(max(round(want, 1), lo), tdp)
