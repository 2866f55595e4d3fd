"""Annotating a straggler with the cause its GPU's telemetry shows."""

from __future__ import annotations

from controller.logic.detection.cause import straggler_cause
from trainguard.wire import GpuSample, ThrottleReason


def gpu(**kw: object) -> GpuSample:
    return GpuSample.model_validate({"index": 0, "sm_clock_mhz": 1980, **kw})


def test_healthy_gpu_has_no_cause() -> None:
    causes, facts = straggler_cause(gpu(), [gpu(), gpu()])
    assert causes == [] and facts["peer_sm_clock_mhz"] == 1980


def test_thermal_power_lock_low_clock_and_ecc_are_each_named() -> None:
    hot = gpu(
        temperature_c=92.4, throttle_reasons=[ThrottleReason.HW_THERMAL_SLOWDOWN], sm_clock_mhz=1300
    )
    assert straggler_cause(hot, [gpu(), gpu()])[0] == [
        "thermal throttling at 92 °C",
        "SM clock 1300 MHz vs 1980 MHz on peers",
    ]
    capped = gpu(
        throttle_reasons=[ThrottleReason.SW_POWER_CAP], locked_sm_clock_mhz=1275, sm_clock_mhz=1275
    )
    assert straggler_cause(capped, [gpu()])[0] == [
        "power throttling or capping",
        "SM clock locked at 1275 MHz",
    ]
    flaky = gpu(ecc_corrected_total=5000)
    assert straggler_cause(flaky, [gpu(ecc_corrected_total=3)])[0] == [
        "5000 correctable ECC errors (peers ≤ 3)"
    ]


def test_no_telemetry_no_cause() -> None:
    assert straggler_cause(None, [gpu()]) == ([], {})
