"""NVML that failed at start is retried (issue 17): a node whose driver comes back recovers
without an agent restart, and a GPU that first answers after start gets XID events.

The NVML module is the simulated driver (pynvml's names and units) behind a stand-in whose
``nvmlInit`` fails a chosen number of times, as on a node whose driver is being reloaded.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.daemon import Agent
from agents.gpu.backend import next_retry_delay_s, open_backend, retry_nvml
from agents.gpu.faults import FaultSpec
from agents.gpu.sim import SimNvml
from agents.settings import load_settings
from agents.xid_events import XidWatcher
from tests.agents.agents_testkit import TOKEN, FakeController


class ComingBackNvml:
    """An NVML module whose ``nvmlInit`` fails ``fails`` times, then works (2 GPUs)."""

    def __init__(self, fails: int) -> None:
        self.sim = SimNvml(gpu_count=2, identity="gpu-node-7")
        self.fails = fails
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.inits <= self.fails:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.sim.nvmlInit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sim, name)


@pytest.fixture
def gpu_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text("")
    return dev


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tgr-") as d:
        yield Path(d)


def test_the_retry_delay_doubles_up_to_its_cap() -> None:
    got = [next_retry_delay_s(a, first_s=5.0, max_s=300.0) for a in range(8)]
    assert got == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    assert next_retry_delay_s(10_000, first_s=5.0, max_s=300.0) == 300.0


def test_retry_nvml_gives_the_working_backend_once_init_succeeds(gpu_dev: Path) -> None:
    module = ComingBackNvml(fails=2)
    broken = open_backend("auto", dev_dir=gpu_dev, nvml=module)
    assert broken.error and broken.api.nvmlDeviceGetCount() == 0
    assert retry_nvml(broken) is None  # second init fails too
    fixed = retry_nvml(broken)
    assert fixed is not None and fixed.error == "" and fixed.kind == "nvml"
    assert fixed.api.nvmlDeviceGetCount() == 2 and fixed.driver_version
    assert retry_nvml(fixed) is None  # nothing to retry on a working backend


def test_a_gpu_that_first_answers_after_start_is_registered_for_xids() -> None:
    api = SimNvml(gpu_count=2)
    api.nvmlInit()
    h0, h1 = (api.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    seen = threading.Event()
    watcher = XidWatcher(api, [h0, None], on_event=lambda e: seen.set())
    watcher.start()
    try:
        assert watcher.registered == [0]
        assert watcher.update_handles([h0, h1]) == [1]
        assert watcher.registered == [0, 1]
        assert watcher.update_handles([h0, h1]) == []  # registered once
        api.inject(FaultSpec(kind="xid", gpu=1, xid_code=13))
        assert seen.wait(5)
        assert [(e.gpu_index, e.code) for e in watcher.drain(1)] == [(1, 13)]
    finally:
        watcher.stop()


def test_an_agent_whose_nvml_comes_back_watches_its_gpus_without_a_restart(
    short_tmp: Path, gpu_dev: Path, agents_controller: FakeController
) -> None:
    module = ComingBackNvml(fails=3)
    s = load_settings(
        controller_url=agents_controller.url, token=TOKEN, node_name="gpu-node-7", gpus="auto",
        dev_dir=gpu_dev, sample_interval_s=0.05, report_interval_s=0.2,
        spool_dir=short_tmp / "spool", socket_path="", metrics_port=-1,
        powercap_dir=short_tmp / "no-powercap", sysfs_root=short_tmp / "no-sys", foreground=False,
    )  # fmt: skip
    agent = Agent(s, backend=open_backend("auto", dev_dir=gpu_dev, nvml=module))
    agent.nvml_retry_first_s, agent.nvml_retry_max_s = 0.05, 0.2
    stop = threading.Event()
    agent.start()
    thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    thread.start()
    try:
        reports = agents_controller.state.ordered

        def recovered() -> bool:
            return any(len(r.node.gpus) == 2 and not r.node.gpu_error for r in reports())

        agents_controller.wait_for(recovered)
        assert agent.nvml_retries == 3 and module.inits == 4  # start + 2 failed + 1 good
        # Registered on a thread of their own (a wedged GPU must not hold up the loop).
        agents_controller.wait_for(lambda: agent.xids is not None and agent.xids.started)
        assert agent.xids is not None and agent.xids.registered == [0, 1]
        module.sim.inject(FaultSpec(kind="xid", gpu=1, xid_code=13))

        def xid_reported() -> bool:
            return any(
                x.code == 13 and x.gpu_index == 1
                for r in reports()
                for sample in r.samples
                for g in sample.gpus
                for x in g.xid_events
            )

        agents_controller.wait_for(xid_reported)
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.stop()
    ordered = agents_controller.state.ordered()
    assert "Driver Not Loaded" in ordered[0].node.gpu_error and ordered[0].node.gpus == []
    last = [r for r in ordered if r.samples][-1]
    assert last.node.backend == "nvml" and last.node.driver_version and not last.node.gpu_error
    assert [g.index for g in last.samples[-1].gpus] == [0, 1]
    assert [g.uuid for g in last.node.gpus] == [g.uuid for g in last.samples[-1].gpus]
