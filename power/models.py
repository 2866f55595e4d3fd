"""Power and throughput as functions of the SM clock, per workload kind.

Two curves, both relative to running unconstrained at the highest clock (f = 1):

* throughput(f) = 1 - s * (1 - f): ``s`` is the clock sensitivity. Compute-bound work
  (training steps, prefill) slows nearly in proportion to the clock; memory-bound decode
  waits on HBM and barely notices (s ≈ 0.3).
* power(f) = floor + (p - floor) * f ** gamma: only the part of the power above a floor
  (idle, HBM, fans) follows the clock; dynamic power goes as f·V² and the voltage drops with
  the clock near the top of the DVFS curve, hence gamma between 1.5 and 2.

The parameters are not measured here. They are chosen to reproduce the published shape:
POLCA reports -20% peak power for at most 7% inference slowdown when clocks are locked,
and Patel et al. ("Characterizing Power Management Opportunities for LLMs in the Cloud",
ASPLOS'24) report prefill as compute-bound and clock-sensitive, decode as memory-bound and
far less so. With the INFERENCE mix below, f = 0.845 gives exactly -20.0% power at -7.0%
throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from power.config import WorkloadKind


@dataclass(kw_only=True, slots=True, frozen=True)
class WorkloadModel:
    kind: WorkloadKind
    clock_sensitivity: float
    """``s``: fraction of throughput lost per fraction of clock removed."""
    power_exponent: float
    """``gamma``: how steeply the clock-dependent power falls with the clock."""
    floor_frac: float
    """Power that does not follow the SM clock, as a fraction of the GPU's TDP."""
    source: str

    def throughput(self, clock_frac: float) -> float:
        f = min(max(clock_frac, 0.0), 1.0)
        return max(0.02, 1.0 - self.clock_sensitivity * (1.0 - f))

    def power(self, uncapped_w: float, clock_frac: float, tdp_w: float) -> float:
        floor = self.floor_frac * tdp_w
        if uncapped_w <= floor:
            return uncapped_w
        f = min(max(clock_frac, 0.0), 1.0)
        scale: float = f**self.power_exponent
        return floor + (uncapped_w - floor) * scale

    def clock_for_power(self, uncapped_w: float, limit_w: float, tdp_w: float) -> float:
        """The clock fraction the GPU's power limiter settles at under ``limit_w``."""
        floor = self.floor_frac * tdp_w
        if uncapped_w <= limit_w or uncapped_w <= floor:
            return 1.0
        if limit_w <= floor:
            return 0.0
        ratio = (limit_w - floor) / (uncapped_w - floor)
        out: float = ratio ** (1.0 / self.power_exponent)
        return out


MODELS: dict[WorkloadKind, WorkloadModel] = {
    WorkloadKind.TRAINING: WorkloadModel(
        kind=WorkloadKind.TRAINING,
        clock_sensitivity=0.9,
        power_exponent=2.0,
        floor_frac=0.2,
        source="dense GEMM-dominated steps are compute-bound; 10% of the step (communication, "
        "data loading) does not scale with the SM clock",
    ),
    WorkloadKind.PREFILL: WorkloadModel(
        kind=WorkloadKind.PREFILL,
        clock_sensitivity=0.95,
        power_exponent=2.0,
        floor_frac=0.2,
        source="prefill is compute-bound (Patel et al. ASPLOS'24)",
    ),
    WorkloadKind.DECODE: WorkloadModel(
        kind=WorkloadKind.DECODE,
        clock_sensitivity=0.3,
        power_exponent=1.5,
        floor_frac=0.3,
        source="decode is memory-bound; SM clock matters little (Patel et al. ASPLOS'24)",
    ),
    WorkloadKind.INFERENCE: WorkloadModel(
        kind=WorkloadKind.INFERENCE,
        clock_sensitivity=0.45,
        power_exponent=1.7,
        floor_frac=0.2,
        source="prefill/decode mix; fitted to POLCA's -20% peak power for <=7% slowdown",
    ),
}

#: Used to translate a clock cap into a power limit when the workload is unknown.
GENERIC = MODELS[WorkloadKind.INFERENCE]


def model_for(kind: WorkloadKind | None) -> WorkloadModel:
    return GENERIC if kind is None else MODELS[kind]


def power_limit_for_clock(
    clock_frac: float, *, tdp_w: float, limit_min_w: float, kind: WorkloadKind | None = None
) -> float:
    """The power limit that bounds a fully loaded GPU as the clock cap ``clock_frac`` would."""
    model = model_for(kind)
    return max(limit_min_w, min(tdp_w, model.power(tdp_w, clock_frac, tdp_w)))
