"""What goes into a policy tick and what comes out of it.

Plain frozen records, apart from the state machine in :mod:`power.policy`, so the controller
can build and store them without reading the policy's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from power.config import Knob, Level, Priority, WorkloadKind
from trainguard.wire import LockClocks, ResetPowerLimit, SetPowerLimit, UnlockClocks

GpuCommand = LockClocks | UnlockClocks | SetPowerLimit | ResetPowerLimit


@dataclass(kw_only=True, slots=True, frozen=True)
class GpuStatus:
    """What the controller knows about one GPU (from the agent's inventory and samples)."""

    server: str
    index: int
    model: str = ""
    priority: Priority = Priority.HIGH
    """Unlabelled work counts as high priority: capping it by surprise is the worse error."""
    workload: WorkloadKind | None = None
    sm_clock_min_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    locked_sm_clock_mhz: int | None = None
    """Lock the agent reports in force now; adopted at first sight."""
    power_limit_w: float | None = None
    """Power limit in force now; adopted at first sight if below the maximum."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One command for one GPU, with the domain, level and reading that caused it."""

    node: str
    gpu_index: int
    command: GpuCommand
    knob: Knob
    domain: str | None
    level: Level
    threshold_frac: float | None
    domain_power_w: float | None
    budget_w: float | None
    reason: str


#: The incidents the policy raises (the controller maps each to an incident kind of its own).
PolicyIncidentKind = Literal[
    "brake",
    "telemetry_stale",
    "clock_command_failed",
    "power_limit_command_failed",
    "gpu_uncappable",
]


@dataclass(frozen=True, slots=True)
class PolicyIncident:
    kind: PolicyIncidentKind
    message: str
    domain: str | None = None
    node: str | None = None
    gpu_index: int | None = None


@dataclass(frozen=True, slots=True)
class DomainStatus:
    name: str
    budget_w: float
    power_w: float
    frac: float
    level: Level
    level_since_s: float
    complete: bool


@dataclass(frozen=True, slots=True)
class ActuationEffect:
    """What a level change did to its domain's power, for the controller's Action record.

    ``observed`` is true when a fresh reading moved by at least ``EFFECT_DELTA_FRAC`` of the
    budget in the expected direction (down after a cap, up after an uncap) before the next
    level change or ``EFFECT_TIMEOUT_S``; ``latency_s`` is then the time until it did.
    """

    domain: str
    from_level: Level
    to_level: Level
    started_s: float
    power_before_w: float
    power_after_w: float
    observed: bool
    latency_s: float


#: How far power must move (fraction of budget) to count as the effect of a level change.
EFFECT_DELTA_FRAC = 0.01
#: Give up waiting for an effect after this long (an uncap on an idle row changes nothing).
EFFECT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class TickResult:
    decisions: list[Decision]
    incidents: list[PolicyIncident]
    domains: dict[str, DomainStatus]
    effects: list[ActuationEffect] = field(default_factory=list)
