"""Why a straggler is slow, from what its GPU's agent reported.

Timing alone names the slow rank; the GPU's own telemetry often says why: thermal or power
throttling (NVML's clock-event reasons), clocks locked or far below the job's other GPUs,
or correctable ECC errors piling up (retries cost time before they become fatal). The
cause goes into the incident's summary and evidence so an operator reads "rank 5 is 18%
slow: thermal throttling at 91 °C" rather than having to correlate dashboards at 3 a.m.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from trainguard.wire import GpuSample, ThrottleReason

THERMAL = {ThrottleReason.HW_THERMAL_SLOWDOWN, ThrottleReason.SW_THERMAL_SLOWDOWN}
POWER = {
    ThrottleReason.SW_POWER_CAP,
    ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    ThrottleReason.HW_SLOWDOWN,
}
#: A clock this far below the peers' median is a cause on its own.
LOW_CLOCK_RATIO = 0.9
#: Correctable ECC errors beyond the most any peer has, to count as "piling up".
ECC_EXCESS = 100


def straggler_cause(
    gpu: GpuSample | None, peers: list[GpuSample]
) -> tuple[list[str], dict[str, Any]]:
    """Human-readable causes and the numbers behind them (both empty when none is seen)."""
    if gpu is None:
        return [], {}
    causes: list[str] = []
    facts: dict[str, Any] = {
        "sm_clock_mhz": gpu.sm_clock_mhz,
        "temperature_c": gpu.temperature_c,
        "throttle_reasons": [str(r) for r in gpu.throttle_reasons],
    }
    reasons = set(gpu.throttle_reasons)
    if reasons & THERMAL:
        causes.append(
            f"thermal throttling at {gpu.temperature_c:.0f} °C"
            if gpu.temperature_c is not None
            else "thermal throttling"
        )
    if reasons & POWER:
        causes.append("power throttling or capping")
    if gpu.locked_sm_clock_mhz:
        causes.append(f"SM clock locked at {gpu.locked_sm_clock_mhz} MHz")
    peer_clocks = [p.sm_clock_mhz for p in peers if p.sm_clock_mhz]
    if gpu.sm_clock_mhz and peer_clocks:
        peer_clock = median(peer_clocks)
        facts["peer_sm_clock_mhz"] = peer_clock
        if gpu.sm_clock_mhz < LOW_CLOCK_RATIO * peer_clock and not gpu.locked_sm_clock_mhz:
            causes.append(f"SM clock {gpu.sm_clock_mhz} MHz vs {peer_clock:.0f} MHz on peers")
    peer_ecc = max((p.ecc_corrected_total or 0 for p in peers), default=0)
    if gpu.ecc_corrected_total is not None and gpu.ecc_corrected_total > peer_ecc + ECC_EXCESS:
        facts["ecc_corrected_total"] = gpu.ecc_corrected_total
        causes.append(f"{gpu.ecc_corrected_total} correctable ECC errors (peers ≤ {peer_ecc})")
    return causes, facts
