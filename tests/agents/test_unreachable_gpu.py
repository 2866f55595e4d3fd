"""A GPU none of whose NVML reads answers, sample after sample (NVML_ERROR_UNKNOWN on every
call: fallen off the bus, or a wedged driver), is reported ``unreachable`` after
``unreachable_after`` samples and clears when it reads again; a GPU whose fields are only
NOT_SUPPORTED, or one failed sample, is not. An XID event wait that keeps failing is
reported (the node's ``gpu_error``) until a wait works again.

The driver is the simulated NVML (pynvml's names and errors) on a clock the test moves.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agents.daemon import Agent
from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml, sim_nvml_function_names
from agents.sampler import GpuSampler
from agents.settings import load_settings
from agents.xid_events import XidWatcher
from tests.agents.agents_testkit import quiet_agent_settings


class Clock:
    """The simulated driver's clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sampler(faults: str, clock: Clock, after: int = 3, **sim: object) -> GpuSampler:
    api = SimNvml(gpu_count=2, faults=parse_fault_specs(faults), clock=clock, **sim)  # type: ignore[arg-type]
    api.nvmlInit()
    sampler = GpuSampler(api, unreachable_after=after)
    sampler.open()
    return sampler


def test_every_read_failing_turns_unreachable_after_k_samples_and_clears() -> None:
    clock = Clock()
    # GPU 1 answers at start, then every call fails with NVML_ERROR_UNKNOWN for 60 s.
    sampler = _sampler("kind=nvml_error,gpu=1,code=999,at=10,duration=60", clock, after=3)
    assert not any(g.unreachable for g in sampler.sample())
    clock.t += 10
    flags = []
    for _ in range(4):
        gpus = sampler.sample()
        assert not gpus[0].unreachable and gpus[0].power_w is not None
        flags.append(gpus[1].unreachable)
    assert flags == [False, False, True, True]
    gpu1 = gpus[1]
    assert gpu1.power_w is None and not gpu1.lost and not gpu1.unknown
    assert gpu1.error.startswith("unreachable: no NVML read answered in 3 samples in a row")
    assert "Unknown Error" in gpu1.error
    # Said once, as an urgent hardware event, not once per sample.
    events = [e for e in sampler.take_events() if e.kind == "gpu_unreachable"]
    assert [e.gpu_index for e in events] == [1]
    assert "no NVML read answered" in events[0].detail

    clock.t += 60  # the GPU answers again
    gpu1 = sampler.sample()[1]
    assert not gpu1.unreachable and gpu1.power_w is not None and gpu1.error == ""


def test_not_supported_everywhere_is_not_unreachable() -> None:
    """A vGPU or MIG slice answers NOT_SUPPORTED for much: that is an answer, not a loss."""
    clock = Clock()
    every_device_call = [n for n in sim_nvml_function_names() if n.startswith("nvmlDevice")]
    sampler = _sampler("", clock, after=2, unsupported_by_gpu={1: every_device_call})
    for _ in range(6):
        gpu1 = sampler.sample()[1]
        assert gpu1.power_w is None and gpu1.error == ""
        assert not gpu1.unreachable


def test_one_failed_sample_is_not_enough_and_a_good_one_resets_the_count() -> None:
    clock = Clock()
    sampler = _sampler(
        "kind=nvml_error,gpu=0,at=10,duration=2;kind=nvml_error,gpu=0,at=13,duration=2",
        clock,
        after=3,
    )
    seen = []
    for step in range(16):
        clock.t = 1000.0 + step
        gpu0 = sampler.sample()[0]
        seen.append(gpu0.unreachable)
        if 10 <= step < 12:
            assert gpu0.power_w is None and "Unknown Error" in gpu0.error
    # Two failed samples, one good, two failed: never three in a row.
    assert not any(seen)


def test_default_is_a_setting() -> None:
    assert load_settings(gpus="sim:1").gpu_unreachable_after == 5
    assert load_settings(gpus="sim:1", gpu_unreachable_after=2).gpu_unreachable_after == 2
    with pytest.raises(Exception, match="gpu_unreachable_after"):
        load_settings(gpus="sim:1", gpu_unreachable_after=0)


def _wait_until(what: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_failing_xid_wait_is_reported_until_a_wait_works() -> None:
    clock = Clock()
    api = SimNvml(
        gpu_count=2,
        faults=parse_fault_specs("kind=nvml_error,gpu=1,at=10,duration=30,events=1"),
        clock=clock,
    )
    api.nvmlInit()
    handles = [api.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    watcher = XidWatcher(api, handles, report_after_s=0.3)
    watcher.start()
    try:
        assert watcher.registered == [0, 1]
        time.sleep(0.3)
        assert watcher.wait_failure == ""
        clock.t += 10  # GPU 1 wedges: every wait on the set fails
        _wait_until(lambda: watcher.wait_failure)
        assert "nvmlEventSetWait_v2 has failed" in watcher.wait_failure
        assert "Unknown Error" in watcher.wait_failure
        assert watcher.alive  # still retrying: not a dead watcher
        clock.t += 30
        _wait_until(lambda: not watcher.wait_failure)
    finally:
        watcher.stop()


def test_the_agent_reports_a_failing_xid_wait_as_gpu_error(short_tmp: Path) -> None:
    settings = quiet_agent_settings(
        short_tmp, "http://127.0.0.1:9", gpus="sim:2", xid_wait_failing_s=0.3
    )
    agent = Agent(settings)
    try:
        api = agent.backend.api
        assert isinstance(api, SimNvml)
        assert agent.xids is not None
        agent.xids.start()
        assert agent._reported_identity().gpu_error == ""
        api.inject(parse_fault_specs("kind=nvml_error,gpu=0,events=1,duration=2")[0])
        _wait_until(lambda: agent.xids is not None and agent.xids.wait_failure)
        agent.sample()
        assert "nvmlEventSetWait_v2 has failed" in agent._reported_identity().gpu_error
        _wait_until(lambda: agent.xids is not None and not agent.xids.wait_failure)
        agent.sample()
        assert agent._reported_identity().gpu_error == ""
    finally:
        agent.stop()
