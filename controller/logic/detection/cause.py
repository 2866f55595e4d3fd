"""Why a straggler is slow, from what its GPU's agent reported.

Timing alone names the slow rank; the GPU's own telemetry often says why: thermal or power
throttling (NVML's clock-event reasons), clocks far below the job's other GPUs, or
correctable ECC errors piling up (retries cost time before they become fatal). The
cause goes into the incident's summary and evidence so an operator reads "rank 5 is 18%
slow: thermal throttling at 91 °C" rather than having to correlate dashboards at 3 a.m.

``causes`` are what is wrong with the GPU: the remediation engine reads any of them as
hardware evidence (``isolate_when: hardware_or_repeat``). A slowdown that trainguard's own
power policy explains is *not* among them, as a GPU obeying our own cap is not degrading
(``controller.services.detection.degraded`` ignores ``sw_power_cap`` for the same reason):

* a locked SM clock: the agent reports only the lock it set itself, on the controller's
  command (``LockClocks``, from the power loop or an operator), so it is always ours;
* ``sw_power_cap`` at the limit trainguard's power policy applied to that GPU
  (:class:`OwnCap`, when the caller knows it).

Those go into the facts as :data:`POLICY_FACT` (e.g. "capped by trainguard's power policy
(250 W)") and the summary, never into ``causes``. Nor is ``sw_power_cap`` at the same limit
as every peer that reports one (:data:`SHARED_FACT`): a cap the whole group shares does not
make this GPU slower than the others, whoever set it. A cap trainguard did not set and no
peer shares, a hardware slowdown, the power brake and thermal throttling stay causes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from statistics import median
from typing import Any

from trainguard.wire import GpuSample, ThrottleReason

THERMAL = {ThrottleReason.HW_THERMAL_SLOWDOWN, ThrottleReason.SW_THERMAL_SLOWDOWN}
#: The hardware slowing itself: the board's power brake or an external slowdown signal.
HARDWARE_SLOWDOWN = {ThrottleReason.HW_POWER_BRAKE_SLOWDOWN, ThrottleReason.HW_SLOWDOWN}
#: A clock this far below the peers' median is a cause on its own.
LOW_CLOCK_RATIO = 0.9
#: Correctable ECC errors beyond the most any peer has, to count as "piling up".
ECC_EXCESS = 100
#: Two enforced power limits this close (W) are the same cap.
LIMIT_TOLERANCE_W = 1.0
#: The fact that says which part of the slowdown trainguard's own power policy explains.
POLICY_FACT = "power_policy"
#: The fact that names a power cap every peer shares (not a cause, not necessarily ours).
SHARED_FACT = "shared_power_cap"
#: How causes written before own caps were told apart began for a clock lock (always ours).
LEGACY_LOCK_CAUSE = "SM clock locked at "


@dataclass(frozen=True, slots=True)
class OwnCap:
    """The power limit trainguard's power policy applies to one GPU now (``None``: none).
    Clock locks need no record: the agent reports only its own (``locked_sm_clock_mhz``)."""

    limit_w: float | None = None


def straggler_cause(
    gpu: GpuSample | None, peers: list[GpuSample], own_cap: OwnCap | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Human-readable causes and the numbers behind them (both empty when none is seen).

    ``own_cap``: the cap trainguard's power policy applied to ``gpu``, when known."""
    if gpu is None:
        return [], {}
    causes: list[str] = []
    policy: list[str] = []
    shared: list[str] = []
    facts: dict[str, Any] = {
        "sm_clock_mhz": gpu.sm_clock_mhz,
        "temperature_c": gpu.temperature_c,
        "throttle_reasons": [str(r) for r in gpu.throttle_reasons],
    }
    if gpu.power_limit_w is not None:
        facts["power_limit_w"] = gpu.power_limit_w
    reasons = set(gpu.throttle_reasons)
    if reasons & THERMAL:
        causes.append(
            f"thermal throttling at {gpu.temperature_c:.0f} °C"
            if gpu.temperature_c is not None
            else "thermal throttling"
        )
    if reasons & HARDWARE_SLOWDOWN:
        causes.append("hardware slowdown or power brake")
    if ThrottleReason.SW_POWER_CAP in reasons:
        words, kind = _power_cap(gpu, peers, own_cap)
        {"ours": policy, "shared": shared, "cause": causes}[kind].append(words)
    locked = gpu.locked_sm_clock_mhz
    if locked:
        policy.append(f"SM clock locked at {locked} MHz by trainguard's power policy")
    peer_clocks = [p.sm_clock_mhz for p in peers if p.sm_clock_mhz]
    if gpu.sm_clock_mhz and peer_clocks:
        peer_clock = median(peer_clocks)
        facts["peer_sm_clock_mhz"] = peer_clock
        # A clock our own cap holds down is explained by it (``policy``), not a cause.
        if gpu.sm_clock_mhz < LOW_CLOCK_RATIO * peer_clock and not policy:
            causes.append(f"SM clock {gpu.sm_clock_mhz} MHz vs {peer_clock:.0f} MHz on peers")
    peer_ecc = max((p.ecc_corrected_total or 0 for p in peers), default=0)
    if gpu.ecc_corrected_total is not None and gpu.ecc_corrected_total > peer_ecc + ECC_EXCESS:
        facts["ecc_corrected_total"] = gpu.ecc_corrected_total
        causes.append(f"{gpu.ecc_corrected_total} correctable ECC errors (peers ≤ {peer_ecc})")
    if policy:
        facts[POLICY_FACT] = "; ".join(policy)
    if shared:
        facts[SHARED_FACT] = "; ".join(shared)
    return causes, facts


def _power_cap(gpu: GpuSample, peers: list[GpuSample], own_cap: OwnCap | None) -> tuple[str, str]:
    """The words for a GPU at its power limit, and whose cap it is: ``ours`` (trainguard's
    power policy), ``shared`` (every peer held at the same limit) or ``cause``."""
    limit = gpu.power_limit_w
    ours = own_cap.limit_w if own_cap is not None else None
    if ours is not None and (limit is None or abs(limit - ours) <= LIMIT_TOLERANCE_W):
        return f"capped by trainguard's power policy ({ours:.0f} W)", "ours"
    at = "" if limit is None else f" at {limit:.0f} W"
    if _peers_capped_at(peers, limit):
        return f"power capped{at}, as every peer is", "shared"
    if limit is not None:
        return f"power capped{at}, a cap trainguard's power policy did not set", "cause"
    return "power throttling or capping", "cause"


def _peers_capped_at(peers: list[GpuSample], limit: float | None) -> bool:
    """Whether every peer is held at its power limit too, the same one where both report
    it: a cap the group shares does not make this GPU slower than the others."""
    return bool(peers) and all(
        ThrottleReason.SW_POWER_CAP in p.throttle_reasons
        and (
            limit is None
            or p.power_limit_w is None
            or abs(p.power_limit_w - limit) <= LIMIT_TOLERANCE_W
        )
        for p in peers
    )


def hardware_causes(causes: Iterable[str]) -> list[str]:
    """The causes that are hardware evidence: all but a clock lock recorded as a cause
    before trainguard's own caps were told apart (the agent locks clocks only on our
    command)."""
    return [c for c in causes if not c.startswith(LEGACY_LOCK_CAUSE)]


__all__ = [
    "LEGACY_LOCK_CAUSE",
    "POLICY_FACT",
    "SHARED_FACT",
    "OwnCap",
    "hardware_causes",
    "straggler_cause",
]
