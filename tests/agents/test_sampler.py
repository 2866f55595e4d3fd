"""The sampler fills every GpuSample field from the backend and survives driver refusals."""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest

from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.sampler import GpuSampler
from agents.xid_events import XidWatcher
from trainguard.wire import GpuSample, ThrottleReason


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def sim(faults: str = "", **kw: object) -> tuple[SimNvml, Clock]:
    clock = Clock()
    api = SimNvml(gpu_count=4, clock=clock, faults=parse_fault_specs(faults), **kw)  # type: ignore[arg-type]
    api.nvmlInit()
    return api, clock


def test_every_field_of_gpu_sample_is_filled() -> None:
    api, clock = sim("kind=thermal,gpu=1,at=0", utilization_pct=97)
    sampler = GpuSampler(api, locked_clock_mhz=lambda i: 1500 if i == 1 else None)
    inventory = sampler.open()
    assert [g.index for g in inventory] == [0, 1, 2, 3]
    assert all(g.uuid.startswith("GPU-") and g.pci_bus_id and g.sm_clock_max_mhz for g in inventory)
    assert inventory[0].power_limit_max_w == 700.0 and inventory[0].memory_total_bytes > 0
    clock.t += 3
    samples = sampler.sample()
    # Page retirement is the pre-Ampere mechanism: an H100 truthfully has none.
    optional_ok = {
        "locked_sm_clock_mhz", "xid_events", "retired_pages_sbe", "retired_pages_dbe",
        "retired_pages_pending",
    }  # fmt: skip
    for sample in samples:
        for name in GpuSample.model_fields:
            if name in optional_ok:
                continue
            assert getattr(sample, name) is not None, name
        assert not sample.lost
        assert 0 < sample.power_w <= sample.power_limit_w  # type: ignore[operator]
        assert sample.memory_used_bytes <= sample.memory_total_bytes  # type: ignore[operator]
    hot = samples[1]
    assert hot.locked_sm_clock_mhz == 1500
    assert ThrottleReason.HW_THERMAL_SLOWDOWN in hot.throttle_reasons
    assert hot.throttle_reasons_mask & 0x40
    # The mask decodes the same way everywhere.
    assert samples[0].throttle_reasons == [] or samples[0].throttle_reasons_mask
    assert hot.energy_j is not None and hot.energy_j > 0


def test_not_supported_fields_become_none_without_a_crash() -> None:
    api, _ = sim(
        unsupported={
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetCurrentClocksEventReasons",
        }
    )
    sampler = GpuSampler(api)
    sampler.open()
    sample = sampler.sample()[0]
    assert sample.energy_j is None and sample.ecc_corrected_total is None
    assert sample.nvlink_crc_errors_total is None and sample.nvlink_replay_errors_total is None
    assert sample.throttle_reasons_mask == 0 and sample.throttle_reasons == []
    assert sample.power_w is not None and sample.temperature_c is not None


def test_an_out_of_range_driver_value_costs_that_field_not_the_sample(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ECC totals of 2^64-1 ("not available") and a power of -1 mW are refused by the wire:
    each becomes null, named in ``error`` and one warning line per (GPU, field), once."""
    api, _ = sim()
    sampler = GpuSampler(api)
    sampler.open()
    api.nvmlDeviceGetTotalEccErrors = lambda h, *a: 2**64 - 1  # type: ignore[method-assign]
    real_power = api.nvmlDeviceGetPowerUsage

    def power(handle: Any) -> int:
        return -1 if handle.index == 1 else real_power(handle)

    api.nvmlDeviceGetPowerUsage = power  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="agents.sampler"):
        samples = sampler.sample()
        sampler.sample()
    first, second = samples[0], samples[1]
    assert not first.unknown and not first.lost and not second.unknown
    assert first.ecc_corrected_total is None and first.ecc_uncorrected_total is None
    assert first.power_w is not None and first.temperature_c is not None
    assert first.error.startswith("out of range: ") and "ecc_corrected_total=" in first.error
    assert second.power_w is None and "power_w=-0.001" in second.error
    assert second.temperature_c is not None and second.energy_j is not None
    lines = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    assert all("\n" not in line for line in lines)
    assert "GPU 1: power_w=-0.001 out of range; reporting null" in lines
    assert len(lines) == len(set(lines)) == 4 * 4 + 1  # 4 ECC fields on 4 GPUs, 1 power


def test_a_lost_gpu_is_reported_lost_once_and_the_rest_keep_sampling() -> None:
    api, clock = sim("kind=lost,gpu=2,at=5")
    lost: list[int] = []
    sampler = GpuSampler(api, on_lost=lost.append)
    sampler.open()
    assert not any(s.lost for s in sampler.sample())
    clock.t += 6
    first, second = sampler.sample(), sampler.sample()
    assert [s.lost for s in first] == [False, False, True, False]
    assert first[2].uuid and first[2].power_w is None
    assert second[2].lost and lost == [2]  # the callback fires once, not every tick


def test_scripted_xid_reaches_the_next_sample_through_the_event_thread() -> None:
    api = SimNvml(gpu_count=4, faults=parse_fault_specs("kind=xid,code=79,gpu=3,at=0.2"))
    api.nvmlInit()
    seen: list[int] = []
    sampler = GpuSampler(api)
    sampler.open()
    watcher = XidWatcher(api, sampler.handles, on_event=lambda e: seen.append(e.code))
    sampler._xid_source = watcher.drain
    watcher.start()
    try:
        assert watcher.registered == [0, 1, 2, 3]
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == [79]
        samples = sampler.sample()
        assert [e.code for e in samples[3].xid_events] == [79]
        assert samples[3].xid_events[0].gpu_index == 3
        assert all(not s.xid_events for s in samples[:3])
        assert sampler.sample()[3].xid_events == []  # delivered once
    finally:
        watcher.stop()
    # The event set was freed on stop.
    assert watcher._event_set is None


def test_event_thread_survives_wait_errors_and_unregistrable_gpus() -> None:
    api = SimNvml(gpu_count=2, unsupported={"nvmlDeviceRegisterEvents"})
    api.nvmlInit()
    sampler = GpuSampler(api)
    sampler.open()
    watcher = XidWatcher(api, sampler.handles)
    watcher.start()
    try:
        assert watcher.registered == []
        api.nvmlShutdown()  # every wait now fails with UNINITIALIZED; the thread must go on
        time.sleep(0.3)
        assert watcher._thread is not None and watcher._thread.is_alive()
    finally:
        api.nvmlInit()
        watcher.stop()
    assert not watcher._thread.is_alive()


def test_real_pynvml_without_a_driver_fails_with_library_not_found() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        assert exc.value in (
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        )
    else:  # a machine with a GPU: the real module is usable by the same sampler
        try:
            sampler = GpuSampler(pynvml)
            sampler.open()
            assert all(isinstance(s, GpuSample) for s in sampler.sample())
        finally:
            pynvml.nvmlShutdown()


def test_older_drivers_without_clock_event_reasons_use_the_throttle_name() -> None:
    api, _ = sim("kind=thermal,gpu=0,at=0", missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    sampler = GpuSampler(api)
    sampler.open()
    for _ in range(2):
        sample = sampler.sample()[0]
        assert ThrottleReason.SW_THERMAL_SLOWDOWN in sample.throttle_reasons
    assert sampler._reasons.uses_throttle_name


def test_simulated_nodes_sharing_a_seed_have_distinct_gpus() -> None:
    a = SimNvml(gpu_count=2, seed=1, identity="node-a")
    b = SimNvml(gpu_count=2, seed=1, identity="node-b")
    again = SimNvml(gpu_count=2, seed=1, identity="node-a")
    for api in (a, b, again):
        api.nvmlInit()
    uuids = [api.nvmlDeviceGetUUID(api.nvmlDeviceGetHandleByIndex(0)) for api in (a, b, again)]
    assert uuids[0] != uuids[1] and uuids[0] == uuids[2]
