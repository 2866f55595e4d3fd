"""Policy configuration and the small vocabularies every module shares.

Every number POLCA fixed is a field here, so an operator can override any of them per power
domain (a child domain inherits its parent's values unless it sets its own).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from power.errors import ConfigError


class Priority(StrEnum):
    """Workload priority class; low-priority GPUs are capped first and harder."""

    HIGH = "high"
    LOW = "low"


class WorkloadKind(StrEnum):
    """What a server runs; decides how its throughput and power respond to a clock cap."""

    TRAINING = "training"
    INFERENCE = "inference"
    PREFILL = "prefill"
    DECODE = "decode"


class Knob(StrEnum):
    """How a cap is applied: locked SM clocks (fast, exact) or an NVML power limit."""

    CLOCKS = "clocks"
    POWER_LIMIT = "power_limit"


class Level(IntEnum):
    """A domain's capping level; higher is more restrictive. Order matters (escalation)."""

    NONE = 0
    T1 = 1  # low priority at the moderate cap
    T2_LP = 2  # low priority at the low cap
    T2_HP = 3  # ... and high priority at its cap
    BRAKE = 4  # everything at the lowest clock / minimum power limit


MAX_POLICY_S = 86_400.0
"""Longest hold, escalation delay, staleness or command timeout a policy may give (one day).
A cap held for ``1e308`` s would never be lifted, and ``now + 1e308`` is no longer a time;
anything past a day is a typo, not a policy."""

#: Sane bounds of a clock override: no GPU clocks below 100 MHz or above 5 GHz. Each
#: override is also clamped into the GPU's own range when applied (power.clocks).
OVERRIDE_MIN_MHZ = 100
OVERRIDE_MAX_MHZ = 5000
#: Keys accepted in ``clock_overrides_mhz[model]`` (one per capped state).
CLOCK_CAP_KEYS = ("lp_t1", "lp_t2", "hp_t2", "brake")


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyConfig:
    """POLCA's thresholds and timings, as fractions of a domain's provisioned budget."""

    t1_frac: float = 0.80
    """Lock low-priority GPUs to the moderate cap at this fraction (POLCA: 80%)."""
    t2_frac: float = 0.89
    """Lower low priority further, then cap high priority (POLCA: 89%, set by its 40 s
    out-of-band actuation and the 11.8% largest inference spike within it)."""
    brake_frac: float = 1.00
    """Emergency brake: everything to the lowest clock or minimum power limit."""
    hysteresis_frac: float = 0.05
    """Uncap only this far below the threshold that caused the cap (POLCA: 5 points)."""
    min_hold_s: float = 60.0
    """Stay at a level at least this long before stepping down one level, so a cap is not
    lifted between two spikes of the same burst. POLCA gives no figure; our assumption."""
    escalate_after_s: float = 5.0
    """At T2, cap high priority only if power is still above T2 this long after lowering
    low priority: one actuation latency plus one telemetry interval."""
    stale_after_s: float = 10.0
    """A reading older than this is stale; a domain with a stale part holds its caps."""
    command_timeout_s: float = 30.0
    """Re-send a command that has not been acknowledged after this long."""
    knob: Knob = Knob.CLOCKS
    """Preferred knob; a GPU whose clock lock failed falls back to power limits."""
    clock_overrides_mhz: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Per GPU model key (``a100``, ``h100`` …): ``{lp_t1, lp_t2, hp_t2, brake}`` in MHz."""

    def __post_init__(self) -> None:
        validate_policy(self, "policy")


def validate_policy(cfg: PolicyConfig, path: str) -> None:
    """Refuse configurations whose state machine would oscillate or never cap."""
    for name in ("t1_frac", "t2_frac", "brake_frac"):
        value = getattr(cfg, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 < value <= 2):
            raise ConfigError(f"{path}.{name}: must be a number in (0, 2], got {value!r}")
    if not cfg.t1_frac <= cfg.t2_frac <= cfg.brake_frac:
        raise ConfigError(
            f"{path}: thresholds must satisfy t1_frac <= t2_frac <= brake_frac, got "
            f"{cfg.t1_frac} / {cfg.t2_frac} / {cfg.brake_frac}"
        )
    if not 0 <= cfg.hysteresis_frac < cfg.t1_frac:
        raise ConfigError(
            f"{path}.hysteresis_frac: must be in [0, t1_frac), got {cfg.hysteresis_frac!r}"
        )
    for name in ("min_hold_s", "escalate_after_s", "stale_after_s", "command_timeout_s"):
        value = getattr(cfg, name)
        if not (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and 0 <= value <= MAX_POLICY_S
        ):
            raise ConfigError(
                f"{path}.{name}: must be a number of seconds in [0, {MAX_POLICY_S:g}], "
                f"got {value!r}"
            )
    if cfg.stale_after_s <= 0:
        raise ConfigError(f"{path}.stale_after_s: must be > 0, got {cfg.stale_after_s!r}")
    if not isinstance(cfg.knob, Knob):
        raise ConfigError(f"{path}.knob: must be one of {[k.value for k in Knob]}")
    for model, caps in cfg.clock_overrides_mhz.items():
        if not isinstance(caps, Mapping):
            raise ConfigError(f"{path}.clock_overrides_mhz.{model}: must be a mapping")
        for key, mhz in caps.items():
            if key not in CLOCK_CAP_KEYS:
                raise ConfigError(
                    f"{path}.clock_overrides_mhz.{model}.{key}: unknown key, "
                    f"expected one of {list(CLOCK_CAP_KEYS)}"
                )
            if (
                isinstance(mhz, bool)
                or not isinstance(mhz, int)
                or not OVERRIDE_MIN_MHZ <= mhz <= OVERRIDE_MAX_MHZ
            ):
                raise ConfigError(
                    f"{path}.clock_overrides_mhz.{model}.{key}: must be a positive integer "
                    f"in [{OVERRIDE_MIN_MHZ}, {OVERRIDE_MAX_MHZ}] (MHz), got {mhz!r}"
                )


POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyConfig))


def policy_with_overrides(base: PolicyConfig, raw: Any, path: str) -> PolicyConfig:
    """``base`` with the fields of the mapping ``raw`` replaced; unknown keys are errors."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping of policy fields")
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in POLICY_FIELDS:
            raise ConfigError(
                f"{path}.{key}: unknown policy field, expected one of {list(POLICY_FIELDS)}"
            )
        if key == "knob":
            try:
                value = Knob(value)
            except ValueError:
                raise ConfigError(
                    f"{path}.knob: must be one of {[k.value for k in Knob]}, got {value!r}"
                ) from None
        elif key == "clock_overrides_mhz":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}.clock_overrides_mhz: must be a mapping")
            value = {**base.clock_overrides_mhz, **{str(k).lower(): v for k, v in value.items()}}
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}.{key}: must be a number, got {value!r}")
        changes[key] = value
    try:
        merged = dataclasses.replace(base, **changes)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("policy", path, 1)) from None
    return merged
