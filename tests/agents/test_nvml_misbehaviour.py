"""A driver that answers badly costs the agent that answer, never its watching (found by
the agent acceptance probe):

- an XID event whose 64-bit ``eventData`` is no XID number (or any exception while handling
  one event) used to kill the XID watcher thread for good, silently;
- ``nvmlDeviceGetCount`` failing after a good ``nvmlInit`` used to end the agent with a
  traceback, the node never reported;
- NVML's "unknown" sentinels (0xFFFFFFFF, 2^64-1) used to be reported as readings (4.3 MW,
  4e9 C) and added to node power.

The driver is the simulated NVML (pynvml's names and units) the other agent tests use.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.daemon import Agent, run
from agents.errors import AgentConfigError, GpuWatchError
from agents.gpu.backend import open_backend
from agents.gpu.faults import FaultSpec, parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.node_power import NodePowerSampler
from agents.sampler import GpuSampler
from agents.settings import AgentSettings
from agents.xid_events import XidWatcher
from tests.agents.agents_testkit import FakeController, quiet_agent_settings
from trainguard.wire import XidEvent


def _settings(tmp: Path, url: str, **extra: Any) -> AgentSettings:
    return quiet_agent_settings(tmp, url, **({"node_name": "gpu-node-9", "gpus": "sim:1"} | extra))


def _sim(count: int = 1) -> SimNvml:
    api = SimNvml(gpu_count=count, identity="gpu-node-9")
    api.nvmlInit()
    return api


# ---------------------------------------------------------------------- F1: XID watcher


def test_an_xid_code_the_wire_cannot_carry_is_dropped_and_the_watcher_goes_on() -> None:
    api = _sim()
    seen = threading.Event()
    watcher = XidWatcher(api, [api.nvmlDeviceGetHandleByIndex(0)], on_event=lambda e: seen.set())
    watcher.start()
    try:
        api.inject(FaultSpec(kind="xid", gpu=0, xid_code=2**64 - 1))  # NVML's 64-bit eventData
        api.inject(FaultSpec(kind="xid", gpu=0, xid_code=79))
        assert seen.wait(5)
        assert [e.code for e in watcher.drain(0)] == [79]
        assert watcher.dropped_total == 1
        assert watcher.alive and watcher.failure == ""
    finally:
        watcher.stop()


def test_an_exception_while_handling_one_event_is_counted_and_the_watcher_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = _sim()
    codes: list[int] = []
    second = threading.Event()

    def on_event(event: XidEvent) -> None:
        codes.append(event.code)
        if len(codes) == 1:
            raise RuntimeError("callback broke")
        second.set()

    watcher = XidWatcher(api, [api.nvmlDeviceGetHandleByIndex(0)], on_event=on_event)
    watcher.start()
    try:
        api.inject(FaultSpec(kind="xid", gpu=0, xid_code=13))
        api.inject(FaultSpec(kind="xid", gpu=0, xid_code=79))
        assert second.wait(5)
        assert codes == [13, 79]
        assert watcher.errors_total == 1 and watcher.alive
        assert [e.code for e in watcher.drain(0)] == [13, 79]
    finally:
        watcher.stop()
    assert any("callback broke" in (r.exc_text or "") for r in caplog.records)


def test_an_xid_watcher_that_dies_anyway_marks_the_node_unhealthy(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = Agent(_settings(short_tmp, "http://127.0.0.1:9"))
    assert agent.xids is not None

    def broken() -> None:
        raise RuntimeError("watcher bug")

    agent.xids._run = broken  # type: ignore[method-assign]
    agent.start()
    try:
        deadline = time.monotonic() + 5  # registration runs on a thread of its own
        while agent.xids._thread is None and time.monotonic() < deadline:
            time.sleep(0.01)
        thread = agent.xids._thread
        assert thread is not None
        thread.join(5)
        assert not agent.xids.alive
        assert "watcher bug" in agent.xids.failure
        assert agent.identity.gpu_error == ""
        agent.sample()
        assert "XID watcher stopped" in agent.identity.gpu_error
        assert "watcher bug" in agent.identity.gpu_error
        agent.sample()  # said once
        assert agent.identity.gpu_error.count("XID watcher stopped") == 1
    finally:
        agent.stop()
    assert any(r.levelname == "ERROR" and "XID watcher" in r.getMessage() for r in caplog.records)


def test_a_fault_spec_xid_code_beyond_the_wire_is_a_config_error() -> None:
    with pytest.raises(AgentConfigError, match="must be <= 2147483647"):
        parse_fault_specs(["kind=xid,gpu=0,code=4294967296"], gpu_count=1)
    assert parse_fault_specs(["kind=xid,gpu=0,code=2147483647"], gpu_count=1)[0].xid_code == (
        2**31 - 1
    )


# ---------------------------------------------------------------------- F2: GPU count


class CountFails(SimNvml):
    """A driver that initialises but cannot count its GPUs ``fails`` times."""

    def __init__(self, fails: int = 10**9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fails = fails
        self.counts = 0

    def nvmlDeviceGetCount(self) -> int:
        self.counts += 1
        if self.counts <= self.fails:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return super().nvmlDeviceGetCount()


def test_a_failing_gpu_count_reports_the_node_unhealthy(short_tmp: Path) -> None:
    # open_backend says the driver failed (it counts once after nvmlInit); the agent only
    # reports what the backend says.
    backend = open_backend("auto", nvml=CountFails(gpu_count=2, identity="gpu-node-9"))
    agent = Agent(_settings(short_tmp, "http://127.0.0.1:9"), backend=backend)
    try:
        assert "nvmlDeviceGetCount: Unknown Error" in agent.identity.gpu_error
        assert agent.backend.error == agent.identity.gpu_error
        assert agent.identity.gpus == []
        assert agent.sample().gpus == []
    finally:
        agent.stop()


def test_a_failing_gpu_count_in_the_foreground_is_one_error_exit_3(
    short_tmp: Path, agents_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SimNvml, "nvmlDeviceGetCount", CountFails.nvmlDeviceGetCount)
    monkeypatch.setattr(SimNvml, "fails", 10**9, raising=False)
    monkeypatch.setattr(SimNvml, "counts", 0, raising=False)
    with pytest.raises(GpuWatchError, match="cannot count the GPUs") as info:
        run(_settings(short_tmp, agents_controller.url, foreground=True))
    assert info.value.exit_code == 3
    agents_controller.wait_for(
        lambda: any(
            "nvmlDeviceGetCount" in r.node.gpu_error for r in agents_controller.state.ordered()
        )
    )


class CountComesBack:
    """An NVML module (as ``pynvml``) whose count fails twice after init, then works."""

    def __init__(self) -> None:
        self.sim = CountFails(fails=2, gpu_count=2, identity="gpu-node-9")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sim, name)


def test_a_gpu_count_that_comes_back_is_adopted_without_a_restart(
    short_tmp: Path, agents_controller: FakeController
) -> None:
    module = CountComesBack()
    backend = open_backend("auto", nvml=module)
    assert backend.kind == "nvml" and "cannot count the GPUs" in backend.error
    agent = Agent(_settings(short_tmp, agents_controller.url, gpus="auto"), backend=backend)
    assert agent.backend.error and agent.identity.gpus == []
    agent.nvml_retry_first_s, agent.nvml_retry_max_s = 0.05, 0.2
    stop = threading.Event()
    agent.start()
    thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    thread.start()
    try:
        agents_controller.wait_for(
            lambda: any(
                len(r.node.gpus) == 2 and not r.node.gpu_error
                for r in agents_controller.state.ordered()
            )
        )
        # Counted by open_backend (fails), the first retry (fails), the second (works)
        # and the adopting sampler.
        assert module.sim.counts == 4 and agent.nvml_retries == 2
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.stop()


# ---------------------------------------------------------------------- F5: sentinels


class Sentinels(SimNvml):
    """Answers NVML's "unknown" values for power, limit, temperature and energy."""

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return 0xFFFFFFFF

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return 0xFFFFFFFF

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return 0xFFFFFFFF

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return 0xFFFFFFFFFFFFFFFF


def test_nvml_unknown_sentinels_are_null_and_named_not_readings() -> None:
    api = Sentinels(gpu_count=1, identity="gpu-node-9")
    api.nvmlInit()
    sampler = GpuSampler(api, timeout_s=2)
    sampler.open()
    try:
        gpu = sampler.sample()[0]
    finally:
        sampler.close()
    assert (gpu.power_w, gpu.power_limit_w, gpu.temperature_c, gpu.energy_j) == (None,) * 4
    for name in ("power_w", "power_limit_w", "temperature_c", "energy_j"):
        assert name in gpu.error
    assert gpu.utilization_gpu_pct is not None  # the rest of the sample stands
    power, source = NodePowerSampler(None, base_power_w=100.0).node_power([gpu])
    assert (power, source) == (100.0, "gpu_sum")


class Implausible(SimNvml):
    """Readings in range for the wire but not for a GPU: 12 kW, 250 C."""

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return 12_000_000

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return 250


def test_implausible_power_and_temperature_are_not_readings() -> None:
    api = Implausible(gpu_count=1, identity="gpu-node-9")
    api.nvmlInit()
    sampler = GpuSampler(api, timeout_s=2)
    sampler.open()
    try:
        gpu = sampler.sample()[0]
    finally:
        sampler.close()
    assert gpu.power_w is None and gpu.temperature_c is None
    assert "power_w=12000.0" in gpu.error and "temperature_c=250.0" in gpu.error
    assert gpu.power_limit_w is not None and gpu.energy_j is not None
