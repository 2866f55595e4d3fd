"""What real NVML does on real clusters, played through the simulated driver (acceptance sweep).

The simulated NVML (:mod:`agents.gpu.sim`) answers with pynvml's names, units (mW, mJ,
MHz, °C) and exception classes; each case here makes it behave as a driver does on some
real node and checks what the agent then reports. The "health" the controller acts on is
the sample's ``unknown`` / ``lost`` flags, the hardware events (``gpu_unknown``,
``nvlink_down``, ...), inactive links in ``nvlinks`` and the identity's ``gpu_error``: a
field that is merely null with its reason in ``error`` does not make a node unhealthy.

- a field NOT_SUPPORTED on one board only (power, ECC, memory clock): null, not 0, no
  error, no health signal;
- a GPU falling off the bus mid-run (XID 79, then NVML_ERROR_GPU_IS_LOST): that GPU is
  reported lost with its XID, once; the others keep being sampled;
- one transient NVML_ERROR_UNKNOWN: that tick's field is null, nothing flaps. Found: on an
  NVLink state read it used to report the link down and, a tick later, up again (an
  urgent report each way); on a link's error counter it made the GPU's sum dip and jump
  back (a reset and a spike to a ``rate()``);
- counters reset by a driver reload (energy, volatile ECC; aggregate ECC when cleared):
  the raw counter goes back, never negative, nothing else moves;
- absurd readings: the 0xFFFFFFFF sentinels were already null; found: a clock above the
  board's maximum (0xFFFF MHz), a temperature of 0 °C and a utilization above 100 %
  (clamped to a "fully busy" 100) were reported as readings. All are null now, named in
  the sample's error, one warning each;
- ``nvmlInit`` failing (driver not loaded, NO_PERMISSION in a non-root container) on a
  node with NVIDIA devices: one ERROR line, the node reports ``gpu_error`` (unhealthy)
  and, in the foreground, the agent exits 3 (``agents.daemon.run``); a board without its
  auxiliary power (INSUFFICIENT_POWER) is an unknown GPU, the others are watched.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.daemon import Agent, run
from agents.errors import GpuWatchError
from agents.gpu.backend import open_backend
from agents.gpu.faults import FaultSpec, parse_fault_spec, parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.node_power import NodePowerSampler
from agents.preflight import _gpu_checks
from agents.sampler import GpuSampler
from agents.settings import AgentSettings
from agents.xid_events import XidWatcher
from tests.agents.agents_testkit import FakeController, quiet_agent_settings
from trainguard.wire import GpuSample, HardwareEvent


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sim(count: int = 2, specs: str = "", **kwargs: Any) -> tuple[SimNvml, Clock]:
    clock = Clock()
    api = SimNvml(
        gpu_count=count, clock=clock, faults=parse_fault_specs(specs) if specs else (), **kwargs
    )
    api.nvmlInit()
    return api, clock


def opened(api: Any, **kwargs: Any) -> GpuSampler:
    sampler = GpuSampler(api, timeout_s=2.0, **kwargs)
    sampler.open()
    return sampler


def health(samples: list[GpuSample], events: list[HardwareEvent]) -> list[str]:
    """What in a tick the controller would act on (empty: nothing)."""
    out = [e.kind for e in events]
    for s in samples:
        out += [f"gpu{s.index} lost"] * s.lost + [f"gpu{s.index} unknown"] * s.unknown
        out += [f"gpu{s.index} nvlink {n.link} down" for n in s.nvlinks if not n.active]
    return out


def _settings(tmp: Path, url: str, **extra: Any) -> AgentSettings:
    return quiet_agent_settings(tmp, url, **extra)


# ------------------------------------------------------------ 1. NOT_SUPPORTED on one board

#: What a consumer board (or a vGPU) refuses that an H100 answers.
CONSUMER_BOARD = {
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetMemoryErrorCounter",
    "nvmlDeviceGetRemappedRows",
}


class NoMemClock(SimNvml):
    """Parts whose driver does not report the memory clock (NOT_SUPPORTED for MEM only)."""

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        if type == pynvml.NVML_CLOCK_MEM and handle.index == 1:
            raise pynvml.NVMLError_NotSupported()
        return int(super().nvmlDeviceGetClockInfo(handle, type))

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        if type == pynvml.NVML_CLOCK_MEM and handle.index == 1:
            raise pynvml.NVMLError_NotSupported()
        return int(super().nvmlDeviceGetMaxClockInfo(handle, type))


def test_the_simulator_refuses_per_board_with_the_real_exception_class() -> None:
    api, _ = sim(2, unsupported_by_gpu={1: CONSUMER_BOARD})
    h0, h1 = api.nvmlDeviceGetHandleByIndex(0), api.nvmlDeviceGetHandleByIndex(1)
    assert api.nvmlDeviceGetPowerUsage(h0) > 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        api.nvmlDeviceGetPowerUsage(h1)
    assert api.nvmlDeviceGetTemperature(h1, pynvml.NVML_TEMPERATURE_GPU) > 0


def test_a_field_not_supported_on_one_board_is_null_not_zero_and_no_health_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    api, clock = sim(2, unsupported_by_gpu={1: CONSUMER_BOARD})
    sampler = opened(api)
    try:
        for _ in range(3):
            clock.t += 1
            good, consumer = samples = sampler.sample()
            assert health(samples, sampler.take_events()) == []
            assert consumer.error == "" and not consumer.unknown and not consumer.lost
            assert (consumer.power_w, consumer.energy_j) == (None, None)
            assert consumer.ecc_corrected_total is None and consumer.ecc_uncorrected_total is None
            assert consumer.ecc_uncorrected_aggregate_total is None
            assert consumer.remapped_rows_uncorrectable is None
            assert consumer.temperature_c is not None and consumer.sm_clock_mhz is not None
            assert good.power_w is not None and good.power_w > 0
            assert good.ecc_uncorrected_total == 0
    finally:
        sampler.close()
    assert not [r for r in caplog.records if r.name == "agents.sampler"]  # not worth a line
    # Node power counts what is known: the consumer board adds nothing, not a made-up 0 W.
    node_w, source = NodePowerSampler(None, base_power_w=100.0).node_power(samples)
    assert source == "gpu_sum" and node_w == pytest.approx(100.0 + (good.power_w or 0))


def test_memory_clocks_not_supported_on_some_parts_are_null_at_start_and_in_samples() -> None:
    api = NoMemClock(gpu_count=2, identity="n")
    api.nvmlInit()
    sampler = opened(api)
    try:
        assert [g.mem_clock_max_mhz is None for g in sampler.inventory] == [False, True]
        good, part = sampler.sample()
    finally:
        sampler.close()
    assert part.mem_clock_mhz is None and part.sm_clock_mhz is not None and part.error == ""
    assert good.mem_clock_mhz == api.model.mem_clock_max_mhz


def test_an_agent_with_a_consumer_board_reports_no_gpu_error(short_tmp: Path) -> None:
    api = SimNvml(gpu_count=2, identity="gpu-node-5", unsupported_by_gpu={1: CONSUMER_BOARD})
    api.nvmlInit()
    backend = open_backend("auto", nvml=api)
    agent = Agent(_settings(short_tmp, "http://127.0.0.1:9", gpus="auto"), backend=backend)
    try:
        sample = agent.sample()
        assert agent.identity.gpu_error == "" and len(agent.identity.gpus) == 2
        assert health(sample.gpus, sample.events) == []
        assert sample.gpus[1].power_w is None and sample.gpus[0].power_w is not None
    finally:
        agent.stop()


def test_preflight_does_not_fail_a_board_for_a_reading_it_does_not_support() -> None:
    api, _ = sim(2, unsupported_by_gpu={1: {"nvmlDeviceGetPowerUsage"}})
    sampler = opened(api)
    try:
        consumer = sampler.sample()[1]
    finally:
        sampler.close()
    sanity = [c for c in _gpu_checks(consumer, []) if c.name == "nvml_sanity"]
    assert [c.status for c in sanity] == ["pass"], sanity
    assert sanity[0].reason.endswith("; not supported by the board: power"), sanity
    failed = consumer.model_copy(update={"error": "power: Unknown Error"})  # asked, no answer
    sanity = [c for c in _gpu_checks(failed, []) if c.name == "nvml_sanity"]
    assert [(c.status, c.reason) for c in sanity] == [
        ("fail", "no answer for power (power: Unknown Error)")
    ]


# ------------------------------------------------------------ 2. a GPU lost mid-run (XID 79)


def test_a_gpu_that_falls_off_the_bus_is_lost_with_its_xid_and_the_others_go_on() -> None:
    api = SimNvml(gpu_count=4, identity="gpu-node-5")
    api.nvmlInit()
    lost: list[int] = []
    xids = XidWatcher(api, [api.nvmlDeviceGetHandleByIndex(i) for i in range(4)])
    sampler = opened(api, on_lost=lost.append, xid_source=xids.drain)
    xids.start()
    try:
        assert health(sampler.sample(), sampler.take_events()) == []
        # What the driver does: XID 79 ("GPU has fallen off the bus"), then every call on
        # that GPU says NVML_ERROR_GPU_IS_LOST.
        api.inject(parse_fault_spec("kind=xid,code=79,gpu=2"))
        api.inject(parse_fault_spec("kind=lost,gpu=2"))
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            api.nvmlDeviceGetPowerUsage(sampler.handles[2])
        deadline = time.monotonic() + 5
        seen: list[int] = []
        while not seen:  # the watcher names the lost GPU by its handle (GetIndex fails)
            assert time.monotonic() < deadline
            first = sampler.sample()
            seen = [e.code for e in first[2].xid_events]
            time.sleep(0.02)
        assert seen == [79]
        assert first[2].lost and first[2].power_w is None
        second = sampler.sample()
        assert [s.lost for s in second] == [False, False, True, False]
        for s in (*first, *second):
            if s.index != 2:
                assert s.power_w is not None and not s.unknown and s.error == ""
        assert lost == [2]  # said once
        assert sampler.take_events() == []  # lost is not "unknown": no flapping signal
        assert xids.alive and xids.dropped_total == 0
    finally:
        xids.stop()
        sampler.close()


def test_an_agent_with_a_lost_gpu_reports_at_once_and_keeps_the_others(short_tmp: Path) -> None:
    agent = Agent(_settings(short_tmp, "http://127.0.0.1:9"))
    api = agent.backend.api
    assert isinstance(api, SimNvml)
    try:
        agent.sample()
        api.inject(FaultSpec(kind="lost", gpu=1))
        sample = agent.sample()
        assert [g.lost for g in sample.gpus] == [False, True, False, False]
        assert agent._urgent.is_set()  # the daemon sends a report now, not at the interval
        assert all(g.power_w is not None for g in sample.gpus if g.index != 1)
        assert agent.identity.gpu_error == ""  # a lost GPU is the GPU's, not the node's watch
    finally:
        agent.stop()


# ------------------------------------------------------------ 3. one transient NVML error


def test_a_transient_fault_fails_its_first_calls_only() -> None:
    api, _ = sim(1)
    h = api.nvmlDeviceGetHandleByIndex(0)
    api.inject(parse_fault_spec("kind=nvml_error,gpu=0,code=999,calls=2"))
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            api.nvmlDeviceGetPowerUsage(h)
    assert api.nvmlDeviceGetPowerUsage(h) > 0
    assert parse_fault_spec("kind=nvml_error,gpu=0,calls=1").to_spec() == (
        "kind=nvml_error,gpu=0,at=0,calls=1"
    )


def test_one_transient_unknown_error_costs_one_field_of_one_tick_and_flaps_nothing() -> None:
    api, clock = sim(2)
    sampler = opened(api)
    try:
        sampler.sample()
        api.inject(
            parse_fault_spec(f"kind=nvml_error,gpu=1,code={pynvml.NVML_ERROR_UNKNOWN},calls=1")
        )
        clock.t += 1
        bad = sampler.sample()
        assert health(bad, sampler.take_events()) == []
        assert bad[1].power_w is None and bad[1].error == "power: Unknown Error"
        assert bad[1].temperature_c is not None  # the next call answered
        clock.t += 1
        after = sampler.sample()
        assert health(after, sampler.take_events()) == []
        assert after[1].power_w is not None and after[1].error == ""
    finally:
        sampler.close()


class FlakyOnce(SimNvml):
    """NVML_ERROR_UNKNOWN once from the next call of ``name`` with ``match`` arguments."""

    _flaky: tuple[str, tuple[Any, ...]] | None = None

    def fail_once(self, name: str, *match: Any) -> None:
        self._flaky = (name, match)

    def _flaky_check(self, name: str, *args: Any) -> None:
        want = self._flaky
        if want and want[0] == name and args[: len(want[1])] == want[1]:
            self._flaky = None
            raise pynvml.NVMLError_Unknown()

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        self._flaky_check("state", device.index, link)
        return int(super().nvmlDeviceGetNvLinkState(device, link))

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        self._flaky_check("counter", device.index, link, counter)
        return int(super().nvmlDeviceGetNvLinkErrorCounter(device, link, counter))


def _flaky(specs: str) -> tuple[FlakyOnce, GpuSampler]:
    api = FlakyOnce(gpu_count=2, identity="n", faults=parse_fault_specs(specs))
    api.nvmlInit()
    return api, opened(api)


def test_a_transient_error_on_an_nvlink_state_is_not_a_link_going_down_and_up() -> None:
    api, sampler = _flaky("kind=nvml_error,gpu=1,at=1e9")  # (no fault due)
    try:
        assert sampler.sample()[0].nvlink_active_count == 18
        api.fail_once("state", 0, 3)
        bad = sampler.sample()
        assert health(bad, sampler.take_events()) == []  # was: nvlink_down, then nvlink_up
        assert bad[0].nvlink_active_count is None  # unknown this tick, not 17
        assert 3 not in [n.link for n in bad[0].nvlinks]
        assert "nvlink state: Unknown Error" in bad[0].error
        again = sampler.sample()
        assert health(again, sampler.take_events()) == []
        assert again[0].nvlink_active_count == 18
        # A link that really goes down still does, once.
        api.inject(parse_fault_spec("kind=nvlink,gpu=0,link=3,down=1"))
        down = sampler.sample()
        assert health(down, sampler.take_events()) == ["nvlink_down", "gpu0 nvlink 3 down"]
        assert down[0].nvlink_active_count == 17
    finally:
        sampler.close()


def test_a_transient_error_on_one_link_counter_makes_the_sum_unknown_not_smaller() -> None:
    api, sampler = _flaky("kind=nvlink,gpu=0,link=0,crc=40;kind=nvlink,gpu=0,link=1,crc=10")
    try:
        assert sampler.sample()[0].nvlink_crc_errors_total == 50
        api.fail_once("counter", 0, 0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
        bad = sampler.sample()[0]
        assert bad.nvlink_crc_errors_total is None  # was 10: a "reset", then +40 again
        assert bad.nvlink_replay_errors_total == 0  # the other counters still add up
        link0 = [n for n in bad.nvlinks if n.link == 0]
        assert link0 == [] or link0[0].crc_errors_total is None
        assert [n.crc_errors_total for n in bad.nvlinks if n.link == 1] == [10]
        assert sampler.sample()[0].nvlink_crc_errors_total == 50
        assert sampler.take_events() == []
    finally:
        sampler.close()


# ------------------------------------------------------------ 4. counters that reset


def test_a_driver_reload_resets_energy_and_volatile_ecc_and_nothing_goes_negative() -> None:
    api, clock = sim(2, "kind=ecc,gpu=0,at=1,corrected=3")
    sampler = opened(api)
    try:
        clock.t += 10
        before = sampler.sample()
        assert before[0].energy_j is not None and before[0].energy_j > 1000  # ~10 s of draw
        assert before[0].ecc_corrected_total == 3 == before[0].ecc_corrected_aggregate_total
        api.inject(parse_fault_spec("kind=reset,gpu=0"))
        clock.t += 2
        after = sampler.sample()
        assert health(after, sampler.take_events()) == []
        zero, other = after
        assert zero.energy_j is not None and 0 <= zero.energy_j < before[0].energy_j
        assert zero.energy_j == pytest.approx(2 * (zero.power_w or 0), rel=0.2)  # since reload
        assert zero.ecc_corrected_total == 0 and zero.ecc_corrected_aggregate_total == 3
        assert (other.energy_j or 0) > (before[1].energy_j or 0) > 0  # untouched
        assert zero.error == "" and not zero.unknown
        # The counter goes on from its new start.
        clock.t += 1
        assert (sampler.sample()[0].energy_j or 0) > zero.energy_j
        # nvidia-smi --clear-ecc-errors: the aggregate counter starts again too.
        api.inject(parse_fault_spec("kind=reset,gpu=0,aggregate=1"))
        api.inject(parse_fault_spec("kind=ecc,gpu=0,at=0.5,uncorrected=1"))
        clock.t += 1
        cleared = sampler.sample()[0]
        assert cleared.ecc_corrected_aggregate_total == 0
        assert cleared.ecc_uncorrected_total == 1 == cleared.ecc_uncorrected_aggregate_total
    finally:
        sampler.close()


# ------------------------------------------------------------ 5. absurd readings


class Absurd(SimNvml):
    """Readings no board gives: clocks of 0xFFFF MHz, 0 °C, a utilization of 0xFFFFFFFF %."""

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        return 0xFFFF

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return 0

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return pynvml.c_nvmlUtilization_t(gpu=0xFFFFFFFF, memory=0xFFFFFFFF)


def test_absurd_clocks_temperature_and_utilization_are_null_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = Absurd(gpu_count=1, identity="n")
    api.nvmlInit()
    sampler = opened(api)
    try:
        first, second = sampler.sample()[0], sampler.sample()[0]
    finally:
        sampler.close()
    for gpu in (first, second):
        assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.temperature_c) == (None, None, None)
        assert gpu.utilization_gpu_pct is None and gpu.utilization_mem_pct is None
        assert gpu.error.startswith("out of range: ") and "sm_clock_mhz=65535" in gpu.error
        assert gpu.power_w is not None and not gpu.unknown  # the rest stands
    lines = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    assert len(lines) == len(set(lines)) == 5  # one per field, not one per tick
    assert "GPU 0: temperature_c=0.0 out of range; reporting null" in lines


def test_a_clock_a_little_above_the_boards_max_is_still_a_reading() -> None:
    class Boost(SimNvml):
        def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
            return int(super().nvmlDeviceGetMaxClockInfo(handle, type) * 1.05)

    api = Boost(gpu_count=1, identity="n")
    api.nvmlInit()
    sampler = opened(api)
    try:
        gpu = sampler.sample()[0]
    finally:
        sampler.close()
    assert gpu.sm_clock_mhz == int(api.model.sm_clock_max_mhz * 1.05) and gpu.error == ""


# ------------------------------------------------------------ 6. nvmlInit failing


class InitFails:
    """The NVML module of a node where ``nvmlInit`` raises pynvml's class for ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(self.code)


@pytest.fixture
def gpu_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        (dev / name).write_text("")
    return dev


@pytest.mark.parametrize(
    ("code", "cls", "text"),
    [
        (
            pynvml.NVML_ERROR_NO_PERMISSION,
            pynvml.NVMLError_NoPermission,
            "Insufficient Permissions",
        ),
        (
            pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
            pynvml.NVMLError_DriverNotLoaded,
            "Driver Not Loaded",
        ),
    ],
)
def test_nvml_init_failing_is_one_error_line_and_an_unhealthy_node(
    code: int,
    cls: type[pynvml.NVMLError],
    text: str,
    gpu_dev: Path,
    short_tmp: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert isinstance(pynvml.NVMLError(code), cls)  # what the module raises
    caplog.set_level(logging.INFO)
    backend = open_backend("auto", dev_dir=gpu_dev, nvml=InitFails(code))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and text in errors[0] and "\n" not in errors[0]
    assert text in backend.error and str(gpu_dev / "nvidia0") in backend.error
    agent = Agent(_settings(short_tmp, "http://127.0.0.1:9", gpus="auto"), backend=backend)
    try:
        assert agent.identity.gpu_error == backend.error and agent.identity.gpus == []
        assert agent.sample().gpus == []
    finally:
        agent.stop()


def test_no_permission_in_the_foreground_reports_then_exits_3(
    gpu_dev: Path,
    short_tmp: Path,
    agents_controller: FakeController,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", InitFails(pynvml.NVML_ERROR_NO_PERMISSION).nvmlInit)
    s = _settings(short_tmp, agents_controller.url, gpus="auto", foreground=True, dev_dir=gpu_dev)
    with pytest.raises(GpuWatchError) as exc:
        run(s)
    assert exc.value.exit_code == 3 and "\n" not in str(exc.value)
    assert "Insufficient Permissions" in str(exc.value)
    reports = agents_controller.state.ordered()
    assert reports and "Insufficient Permissions" in reports[0].node.gpu_error


class UnpoweredBoard(SimNvml):
    """GPU 1's auxiliary power cable is not connected: its handle says INSUFFICIENT_POWER."""

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index == 1:
            raise pynvml.NVMLError_InsufficientPower()
        return super().nvmlDeviceGetHandleByIndex(index)


def test_a_board_without_its_power_cable_is_unknown_and_the_others_are_watched() -> None:
    api = UnpoweredBoard(gpu_count=3, identity="n")
    api.nvmlInit()
    sampler = opened(api)
    try:
        samples = sampler.sample()
        events = sampler.take_events()
        assert health(samples, events) == ["gpu_unknown", "gpu1 unknown"]
        assert "Insufficient External Power" in samples[1].error
        assert samples[0].power_w is not None and samples[2].power_w is not None
        assert health(sampler.sample(), sampler.take_events()) == ["gpu1 unknown"]  # no flap
    finally:
        sampler.close()


def test_the_xid_watcher_outlives_a_gpu_that_refuses_registration() -> None:
    api, _ = sim(2, unsupported_by_gpu={1: {"nvmlDeviceRegisterEvents"}})
    watcher = XidWatcher(api, [api.nvmlDeviceGetHandleByIndex(i) for i in range(2)])
    seen = threading.Event()
    watcher._on_event = lambda _e: seen.set()
    watcher.start()
    try:
        assert watcher.registered == [0]
        api.inject(FaultSpec(kind="xid", gpu=0, xid_code=31))
        assert seen.wait(5) and [e.code for e in watcher.drain(0)] == [31]
    finally:
        watcher.stop()
