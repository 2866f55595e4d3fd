"""The simulated NVML mirrors pynvml: names, signatures, units, error classes, physics."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml, sim_nvml_function_names

# Every NVML function the agent calls (sampler, XID watcher, command executor, backend).
USED_BY_AGENT = {
    "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetPowerManagementDefaultLimit", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlDeviceGetMemoryErrorCounter",
    "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetGpuFabricInfo",
    "nvmlDeviceGetMigMode",
}  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: FakeClock, faults: str = "", **kw: Any) -> tuple[SimNvml, list[object]]:
    api = SimNvml(
        gpu_count=4, faults=parse_fault_specs(faults) if faults else (), clock=clock, **kw
    )
    api.nvmlInit()
    return api, [api.nvmlDeviceGetHandleByIndex(i) for i in range(4)]


def test_every_sim_function_exists_in_pynvml_with_the_same_parameters() -> None:
    names = sim_nvml_function_names()
    real = set(dir(pynvml))
    assert set(names) <= real, sorted(set(names) - real)
    for name in names:
        sim_params = list(inspect.signature(getattr(SimNvml, name)).parameters)[1:]  # drop self
        real_params = list(inspect.signature(getattr(pynvml, name)).parameters)
        assert sim_params == real_params, name


def test_the_sim_implements_every_function_the_agent_calls() -> None:
    assert set(sim_nvml_function_names()) >= USED_BY_AGENT
    assert set(dir(pynvml)) >= USED_BY_AGENT


def test_units_and_return_types_follow_nvml() -> None:
    clock = FakeClock()
    api, (h, *_) = make(clock, utilization_pct=100)
    clock.t += 10
    power_mw = api.nvmlDeviceGetPowerUsage(h)
    assert isinstance(power_mw, int) and 300_000 < power_mw <= 700_000  # mW of a busy H100
    lo, hi = api.nvmlDeviceGetPowerManagementLimitConstraints(h)
    assert (lo, hi) == (200_000, 700_000)
    assert api.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980  # MHz
    pci = api.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId == "00000000:18:00.0"
    mem = api.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and mem.used + mem.free == mem.total
    util = api.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t) and util.gpu == 100
    # Energy (mJ) is the integral of power: 10 s at ~power_mw.
    energy_mj = api.nvmlDeviceGetTotalEnergyConsumption(h)
    assert energy_mj == pytest.approx(power_mw * 10, rel=0.02)


def test_errors_are_pynvml_classes_with_real_codes() -> None:
    clock = FakeClock()
    api = SimNvml(gpu_count=2, clock=clock, no_permission=True)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        api.nvmlDeviceGetCount()
    api.nvmlInit()
    h = api.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        api.nvmlDeviceGetHandleByIndex(5)
    with pytest.raises(pynvml.NVMLError_NoPermission) as exc:
        api.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    assert exc.value.value == pynvml.NVML_ERROR_NO_PERMISSION
    assert str(exc.value) == "Insufficient Permissions"
    event_set = api.nvmlEventSetCreate()
    api.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        api.nvmlEventSetWait_v2(event_set, 20)
    api.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        api.nvmlEventSetWait_v2(event_set, 0)
    api.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        api.nvmlDeviceGetPowerUsage(h)


def test_power_cap_and_clock_lock_have_visible_effects() -> None:
    clock = FakeClock()
    api, (h, *_) = make(clock, utilization_pct=100)
    base_power = api.nvmlDeviceGetPowerUsage(h)
    api.nvmlDeviceSetPowerManagementLimit(h, 350_000)
    assert api.nvmlDeviceGetPowerUsage(h) <= 350_000 < base_power
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) < 1980
    assert api.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonSwPowerCap
    api.nvmlDeviceSetPowerManagementLimit(h, 700_000)
    api.nvmlDeviceSetGpuLockedClocks(h, 500, 1200)
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1200
    assert api.nvmlDeviceGetPowerUsage(h) < base_power * 0.6
    api.nvmlDeviceResetGpuLockedClocks(h)
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        api.nvmlDeviceSetPowerManagementLimit(h, 900_000)


def test_scripted_faults_follow_the_clock() -> None:
    clock = FakeClock()
    faults = (
        "kind=thermal,gpu=1,at=5;kind=ecc,gpu=2,at=3,corrected=4,uncorrected=1;kind=lost,gpu=3,at=8"
    )
    api, handles = make(clock, faults, utilization_pct=90)
    ecc = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert api.nvmlDeviceGetTotalEccErrors(handles[2], ecc, pynvml.NVML_VOLATILE_ECC) == 0
    cool = api.nvmlDeviceGetTemperature(handles[1], pynvml.NVML_TEMPERATURE_GPU)
    clock.t += 12
    hot = api.nvmlDeviceGetTemperature(handles[1], pynvml.NVML_TEMPERATURE_GPU)
    assert hot >= 88 and hot > cool + 15
    thermal_bits = (
        pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    )
    assert api.nvmlDeviceGetCurrentClocksEventReasons(handles[1]) & thermal_bits == thermal_bits
    assert api.nvmlDeviceGetClockInfo(handles[1], pynvml.NVML_CLOCK_SM) < 1980
    assert api.nvmlDeviceGetTotalEccErrors(handles[2], ecc, pynvml.NVML_VOLATILE_ECC) == 1
    corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    assert api.nvmlDeviceGetTotalEccErrors(handles[2], corrected, pynvml.NVML_VOLATILE_ECC) == 4
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        api.nvmlDeviceGetPowerUsage(handles[3])
    assert api.nvmlDeviceGetCount() == 4  # a lost GPU still counts, as with the real driver


def test_xid_event_is_delivered_once_at_its_time() -> None:
    clock = FakeClock()
    api, handles = make(clock, "kind=xid,code=79,gpu=2,at=4")
    event_set = api.nvmlEventSetCreate()
    for h in handles:
        api.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        api.nvmlEventSetWait_v2(event_set, 10)
    clock.t += 5
    data = api.nvmlEventSetWait_v2(event_set, 10)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError and data.eventData == 79
    assert api.nvmlDeviceGetIndex(data.device) == 2
    with pytest.raises(pynvml.NVMLError_Timeout):
        api.nvmlEventSetWait_v2(event_set, 10)


def test_same_seed_same_numbers_other_seed_other_numbers() -> None:
    def trace(seed: int) -> list[int]:
        clock = FakeClock()
        api = SimNvml(gpu_count=2, seed=seed, clock=clock)
        api.nvmlInit()
        h = api.nvmlDeviceGetHandleByIndex(1)
        out = []
        for _ in range(40):
            clock.t += 0.25
            out.append(api.nvmlDeviceGetPowerUsage(h))
        return out + [int(c) for c in api.nvmlDeviceGetUUID(h).encode()]

    assert trace(7) == trace(7)
    assert trace(7) != trace(8)
    # The load pattern is training-like: busy most of the time, with dips.
    powers = trace(7)[:40]
    busy = sum(p > 400_000 for p in powers)
    assert 20 <= busy < 40, powers


def test_lost_gpu_does_not_affect_the_others() -> None:
    clock = FakeClock()
    api, handles = make(clock, "kind=lost,gpu=0,at=1")
    clock.t += 2
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        api.nvmlDeviceGetPowerUsage(handles[0])
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # as the driver: no new handle either
        api.nvmlDeviceGetHandleByIndex(0)
    for h, i in itertools.product(handles[1:], [0]):
        assert api.nvmlDeviceGetPowerUsage(h) > i


def test_faults_injected_at_run_time_count_from_the_moment_they_are_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agents.gpu.fault_file import FaultFile

    clock = FakeClock()
    api, handles = make(clock)
    event_set = api.nvmlEventSetCreate()
    for h in handles:
        api.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    clock.t += 100  # long after the driver started: "at" must not count from its start
    path = tmp_path / "faults"
    follow = FaultFile(path)
    assert follow.poll() == []  # no file yet
    path.write_text("kind=xid,code=79,gpu=1,at=2\nkind=thermal,gpu=3,at=0,dur")
    (fault,) = follow.poll()  # the unfinished second line waits for its newline
    due = api.inject(fault)
    assert due.at_s == pytest.approx(102.0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        api.nvmlEventSetWait_v2(event_set, 10)
    clock.t += 3
    data = api.nvmlEventSetWait_v2(event_set, 10)
    assert data.eventData == 79 and api.nvmlDeviceGetIndex(data.device) == 1
    with path.open("a") as f:
        f.write("ation=60\nkind=bogus\n")
    (thermal,) = follow.poll()  # the bad line is logged and skipped
    api.inject(thermal)
    clock.t += 30
    assert api.nvmlDeviceGetTemperature(handles[3], pynvml.NVML_TEMPERATURE_GPU) >= 88
    with pytest.raises(ValueError, match="gpu 9 out of range"):
        api.inject(dataclasses.replace(fault, gpu=9))


def test_a_fault_file_rewritten_instead_of_appended_is_read_again_from_the_start(
    tmp_path: Path,
) -> None:
    from agents.gpu.fault_file import FaultFile

    path = tmp_path / "faults"
    follow = FaultFile(path)
    path.write_text("kind=xid,code=79,gpu=3,at=0\nkind=thermal,gpu=1,at=0,duration=5\n")
    assert len(follow.poll()) == 2
    path.write_text("kind=lost,gpu=0\n")  # echo spec > file: shorter than what was read
    assert [(f.kind, f.gpu) for f in follow.poll()] == [("lost", 0)]
    assert follow.poll() == []
    path.write_text("kind=xid,code=48,gpu=2\nkind=lost,gpu=1\n")  # longer, other bytes
    assert [(f.kind, f.gpu) for f in follow.poll()] == [("xid", 2), ("lost", 1)]
    # The very same bytes written again: only the modification time says so.
    before = path.stat().st_mtime_ns
    path.write_text("kind=xid,code=48,gpu=2\nkind=lost,gpu=1\n")
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert [(f.kind, f.gpu) for f in follow.poll()] == [("xid", 2), ("lost", 1)]
    assert follow.poll() == []
    # Replaced by another file (an editor's save) that starts the same: all of it is new.
    fresh = tmp_path / "faults.new"
    fresh.write_text("kind=xid,code=48,gpu=2\nkind=lost,gpu=1\nkind=lost,gpu=3\n")
    os.replace(fresh, path)
    assert [f.gpu for f in follow.poll()] == [2, 1, 3]
    with path.open("a") as f:  # appending still yields only the new line
        f.write("kind=lost,gpu=0\n")
    assert [f.gpu for f in follow.poll()] == [0]


def test_a_fault_line_for_a_gpu_the_node_lacks_is_refused_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agents.gpu.fault_file import FaultFile

    path = tmp_path / "faults"
    path.write_text("kind=lost,gpu=99\nkind=xid,code=79,gpu=1\nkind=lost,gpu=-1\n")
    caplog.set_level(logging.WARNING, logger="agents.gpu.fault_file")
    (fault,) = FaultFile(path).poll(gpu_count=4)
    assert (fault.kind, fault.gpu) == ("xid", 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        f"ignoring fault line in {path}: gpu 99 out of range (the node has 4): kind=lost,gpu=99"
    )
    assert len(lines) == 2 and all("\n" not in line for line in lines)


def test_fault_file_that_cannot_be_read_is_refused_at_start_and_logged_once_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agents.errors import AgentConfigError
    from agents.gpu.fault_file import FaultFile

    path = tmp_path / "faults"
    FaultFile(path).check()  # not there yet: followed until it appears
    path.write_bytes(b"\xffkind=xid\n")
    with pytest.raises(AgentConfigError) as info:
        FaultFile(path).check()
    assert str(info.value) == f"sim_fault_file {path}: not UTF-8 text"
    path.unlink()
    path.mkdir()
    with pytest.raises(AgentConfigError) as info:
        FaultFile(path).check()
    assert str(info.value) == f"sim_fault_file {path}: Is a directory"
    follow = FaultFile(path)  # became a directory while running: no faults, one warning
    caplog.set_level(logging.WARNING, logger="agents.gpu.fault_file")
    assert follow.poll() == [] and follow.poll() == []
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot read sim fault file {path}: Is a directory"
    ]
    path.rmdir()
    path.write_text("kind=xid,code=79,gpu=1,at=0\n")
    (fault,) = follow.poll()
    assert fault.xid_code == 79
