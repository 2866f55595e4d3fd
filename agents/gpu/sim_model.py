"""The physics behind the simulated GPUs: load drives clocks, power and temperature.

Only the relationships that make the agent's work visible are modelled, with H100-like
numbers: dynamic power grows with utilization and with clock roughly as f^2.4 (voltage
scales with frequency), so a power cap lowers the SM clock until the draw meets the cap
and sets ``SW_POWER_CAP``, a locked clock lowers power, and a thermal fault raises the
temperature, sets the thermal bits and drops clocks. Every value is a pure function of
(seed, GPU, time, settings), so two runs with the same seed see the same numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pynvml

#: Exponent of dynamic power versus clock; P ~ f * V^2 with V roughly linear in f near boost.
_POWER_CLOCK_EXPONENT = 2.4


@dataclass(kw_only=True, slots=True, frozen=True)
class SimGpuModel:
    """Static properties of the simulated board (defaults: an H100 SXM5 80 GB)."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_total_bytes: int = 81_559 * 1024 * 1024
    power_limit_min_mw: int = 200_000
    power_limit_max_mw: int = 700_000
    power_limit_default_mw: int = 700_000
    #: Board power with nothing running (W).
    idle_power_w: float = 70.0
    #: Draw at 100 % utilization and full boost clock, unconstrained (W). Kept below the
    #: default limit so caps, not the default, are what throttles in the demo.
    peak_power_w: float = 650.0
    sm_clock_max_mhz: int = 1980
    sm_clock_idle_mhz: int = 345
    mem_clock_max_mhz: int = 2619
    ambient_c: float = 30.0
    #: Steady-state temperature rise per watt (K/W).
    thermal_resistance_c_per_w: float = 0.075
    #: Extra heating during a thermal fault (a failed fan, a blocked inlet), in K, reached
    #: over ``thermal_ramp_s``; large enough to land in the 90s °C despite the lower clock.
    thermal_excursion_c: float = 45.0
    thermal_ramp_s: float = 5.0
    #: SM clock fraction while thermally throttled.
    thermal_clock_fraction: float = 0.6
    pcie_gen_max: int = 5
    pcie_width_max: int = 16
    nvlink_count: int = 18
    #: Row remapping (Ampere and later) vs. page retirement (Volta/Turing): a board has one.
    row_remapping: bool = True
    page_retirement: bool = False
    #: ``nvmlDeviceGetGpuFabricInfo`` answers (Hopper and later in an NVSwitch system).
    fabric_supported: bool = True
    #: MIG mode at start (``NVML_DEVICE_MIG_DISABLE`` / ``_ENABLE``); H100 supports MIG.
    mig_mode: int = 0
    #: MIG instances on each GPU in MIG mode, in its first slots (one pod per slice, the
    #: usual MIG node); the other slots are empty (NOT_FOUND). At most ``mig_slots``.
    mig_instances: int = 0
    #: ``nvmlDeviceGetMaxMigDeviceCount`` of a GPU in MIG mode: 7 on an H100 or A100
    #: (seven 1g slices).
    mig_slots: int = 7
    #: Memory locations whose ECC counters answer (others raise NOT_SUPPORTED), as on H100.
    ecc_locations: tuple[str, ...] = ("dram", "sram")
    #: Training-step period of the default load pattern (s) and its busy fraction.
    step_period_s: float = 2.0
    busy_fraction: float = 0.85

    def __post_init__(self) -> None:
        if not 0 <= self.mig_instances <= self.mig_slots:
            raise ValueError(
                f"mig_instances={self.mig_instances}: a GPU has {self.mig_slots} MIG slots"
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class GpuState:
    """What the board looks like at one instant."""

    utilization_gpu_pct: int
    utilization_mem_pct: int
    sm_clock_mhz: int
    mem_clock_mhz: int
    power_w: float
    temperature_c: float
    throttle_mask: int
    memory_used_bytes: int


def utilization_pct(model: SimGpuModel, *, seed: int | str, gpu: int, t_s: float) -> int:
    """Training-like load: busy most of each step, a dip for the collective/data phase."""
    if t_s < 0:
        return 0
    bucket = int(t_s * 10)
    noise = random.Random(f"{seed}:{gpu}:{bucket}").random()
    phase = (t_s % model.step_period_s) / model.step_period_s
    if phase < model.busy_fraction:
        return min(100, 95 + int(noise * 6))
    return 25 + int(noise * 15)


def gpu_state(
    model: SimGpuModel,
    *,
    utilization: int,
    power_limit_w: float,
    locked_max_mhz: int | None,
    thermal_elapsed_s: float | None,
    seed: int | str,
    gpu: int,
    t_s: float,
    slowdown_mhz: int | None = None,
    slowdown_reasons: int = 0,
) -> GpuState:
    """Solve clocks, power and temperature for one GPU at ``t_s``.

    ``thermal_elapsed_s`` is the time since a thermal fault began (None when none is active).
    ``slowdown_mhz`` caps the SM clock of a busy GPU (a board stuck slow: a stuck slowdown
    signal, a broken power stage) and ``slowdown_reasons`` are the clock-event reason bits
    that come with it (none: slow without saying why, which happens too).
    """
    u = utilization / 100.0
    mask = 0
    f_max = float(model.sm_clock_max_mhz)
    if u <= 0:
        clock = float(model.sm_clock_idle_mhz)
        mask |= pynvml.nvmlClocksEventReasonGpuIdle
    else:
        clock = f_max
    if locked_max_mhz is not None and locked_max_mhz < clock:
        clock = float(locked_max_mhz)
        mask |= pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    if thermal_elapsed_s is not None:
        thermal_clock = f_max * model.thermal_clock_fraction
        if thermal_clock < clock:
            clock = thermal_clock
        mask |= (
            pynvml.nvmlClocksEventReasonSwThermalSlowdown
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        )
    if u > 0 and slowdown_mhz is not None and slowdown_mhz < clock:
        clock = float(slowdown_mhz)
    mask |= slowdown_reasons
    dynamic_peak = model.peak_power_w - model.idle_power_w
    power = model.idle_power_w + dynamic_peak * u * (clock / f_max) ** _POWER_CLOCK_EXPONENT
    if power > power_limit_w and u > 0:
        # The driver lowers the clock until the draw fits under the cap.
        ratio = max(power_limit_w - model.idle_power_w, 1.0) / (dynamic_peak * u)
        clock = min(clock, f_max * ratio ** (1 / _POWER_CLOCK_EXPONENT))
        power = min(
            power_limit_w,
            model.idle_power_w + dynamic_peak * u * (clock / f_max) ** _POWER_CLOCK_EXPONENT,
        )
        mask |= pynvml.nvmlClocksEventReasonSwPowerCap
    jitter = random.Random(f"p:{seed}:{gpu}:{int(t_s * 10)}").uniform(-0.01, 0.0)
    power = max(0.0, power * (1.0 + jitter))
    temperature = model.ambient_c + model.thermal_resistance_c_per_w * power
    if thermal_elapsed_s is not None:
        ramp = min(1.0, thermal_elapsed_s / model.thermal_ramp_s) if model.thermal_ramp_s else 1.0
        temperature += model.thermal_excursion_c * ramp
    used = int(model.memory_total_bytes * 0.86) if u > 0 else 512 * 1024 * 1024
    return GpuState(
        utilization_gpu_pct=utilization,
        utilization_mem_pct=int(60 * u * clock / f_max),
        sm_clock_mhz=round(clock),
        mem_clock_mhz=model.mem_clock_max_mhz,
        power_w=power,
        temperature_c=temperature,
        throttle_mask=mask,
        memory_used_bytes=used,
    )


__all__ = ["GpuState", "SimGpuModel", "gpu_state", "utilization_pct"]
