"""Never pretend: ``gpus: auto`` is NVML or zero GPUs, a broken driver is an unhealthy node.

The NVML module is the real ``pynvml`` (on this CPU machine its ``nvmlInit`` fails with
"NVML Shared Library Not Found"), or a stand-in whose ``nvmlInit`` fails with a chosen
code, or the simulated driver handed in *as* the NVML module (a GPU node in a test).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.daemon import Agent, run
from agents.errors import AgentConfigError, BackendUnavailableError, GpuWatchError
from agents.gpu.backend import NoGpus, nvidia_device_files, open_backend
from agents.gpu.sim import SimNvml
from agents.settings import load_settings
from tests.agents.agents_testkit import TOKEN, FakeController


class BrokenNvml:
    """The NVML module of a node whose driver broke: ``nvmlInit`` fails with ``code``."""

    def __init__(self, code: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED) -> None:
        self.code = code

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(self.code)


def real_nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture
def gpu_dev(tmp_path: Path) -> Path:
    """A /dev with the files the NVIDIA driver creates on a two-GPU node."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).write_text("")
    return dev


@pytest.fixture
def bare_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "bare-dev"
    dev.mkdir()
    (dev / "null").write_text("")
    return dev


def test_device_files_are_found_by_name(gpu_dev: Path, bare_dev: Path) -> None:
    assert nvidia_device_files(gpu_dev) == ["nvidia-uvm", "nvidia0", "nvidia1", "nvidiactl"]
    assert nvidia_device_files(bare_dev) == []
    assert nvidia_device_files(bare_dev / "missing") == []


@pytest.mark.parametrize("mode", ["auto", "nvml"])
@pytest.mark.parametrize("devices", [True, False])
@pytest.mark.parametrize(
    "nvml", ["real", "broken", "gpu-node"], ids=["real-pynvml", "broken", "working"]
)
def test_auto_and_nvml_never_yield_simulated_gpus(
    mode: str, devices: bool, nvml: str, gpu_dev: Path, bare_dev: Path
) -> None:
    module: Any = {"real": pynvml, "broken": BrokenNvml(), "gpu-node": SimNvml(gpu_count=2)}[nvml]
    dev = gpu_dev if devices else bare_dev
    try:
        backend = open_backend(mode, dev_dir=dev, nvml=module)
    except BackendUnavailableError as exc:
        # Only "nvml" on a node without devices and without a driver may refuse to start.
        assert mode == "nvml" and not devices and "no NVIDIA device files" in str(exc)
        assert exc.exit_code == 2
        return
    assert backend.kind == "nvml"
    if isinstance(backend.api, SimNvml):
        assert backend.api is module  # the "driver" handed in, never one made up here
    count = backend.api.nvmlDeviceGetCount()
    if isinstance(backend.api, NoGpus):
        assert count == 0
        assert bool(backend.error) == devices  # a GPU node that cannot be watched says so
    backend.shutdown()


def test_a_broken_driver_on_a_gpu_node_is_an_error_with_the_nvml_text(gpu_dev: Path) -> None:
    backend = open_backend("auto", dev_dir=gpu_dev, nvml=BrokenNvml())
    assert backend.kind == "nvml" and isinstance(backend.api, NoGpus)
    assert backend.error.startswith("NVML failed (Driver Not Loaded) although NVIDIA devices")
    assert str(gpu_dev / "nvidia-uvm") in backend.error and "1 more" in backend.error


def test_a_node_without_devices_has_zero_gpus_and_no_error(bare_dev: Path) -> None:
    backend = open_backend("auto", dev_dir=bare_dev, nvml=BrokenNvml())
    assert backend.error == "" and backend.api.nvmlDeviceGetCount() == 0


def test_simulation_only_when_asked_and_faults_need_it(bare_dev: Path) -> None:
    backend = open_backend("sim:3", dev_dir=bare_dev)
    assert backend.kind == "sim" and backend.api.nvmlDeviceGetCount() == 3
    with pytest.raises(AgentConfigError, match="scripted faults need simulated GPUs"):
        open_backend("auto", fault_specs=["kind=lost,gpu=1"], dev_dir=bare_dev)
    with pytest.raises(AgentConfigError, match="gpu=9 but only 8"):
        open_backend("sim:8", fault_specs=["kind=lost,gpu=9"])


def agent_settings(tmp: Path, url: str, dev: Path, **kw: Any) -> Any:
    return load_settings(
        controller_url=url,
        token=TOKEN,
        node_name="gpu-node-7",
        gpus="auto",
        dev_dir=dev,
        sample_interval_s=0.05,
        report_interval_s=0.2,
        spool_dir=tmp / "spool",
        socket_path="",
        metrics_port=-1,
        powercap_dir=tmp / "no-powercap",
        sysfs_root=tmp / "no-sys",
        **kw,
    )


def test_a_daemon_on_a_broken_gpu_node_keeps_reporting_itself_unhealthy(
    short_tmp: Path, gpu_dev: Path, agents_controller: FakeController
) -> None:
    s = agent_settings(short_tmp, agents_controller.url, gpu_dev, foreground=False)
    agent = Agent(s, backend=open_backend("auto", dev_dir=gpu_dev, nvml=BrokenNvml()))
    stop = threading.Event()
    agent.start()
    thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    thread.start()
    try:
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 2)
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.stop()
    for report in agents_controller.state.ordered():
        assert report.node.backend == "nvml" and report.node.gpus == []
        assert "Driver Not Loaded" in report.node.gpu_error
        assert all(sample.gpus == [] for sample in report.samples)


def test_started_in_the_foreground_it_reports_then_exits_3(
    short_tmp: Path, gpu_dev: Path, agents_controller: FakeController
) -> None:
    if real_nvml_works():
        pytest.skip("this machine has a working NVML")
    s = agent_settings(short_tmp, agents_controller.url, gpu_dev, foreground=True)
    with pytest.raises(GpuWatchError) as exc:
        run(s)  # the real pynvml, which fails here
    assert exc.value.exit_code == 3 and "\n" not in str(exc.value)
    assert "NVML Shared Library Not Found" in str(exc.value)
    assert "reported node gpu-node-7 unhealthy" in str(exc.value)
    reports = agents_controller.state.ordered()
    assert reports and "NVML Shared Library Not Found" in reports[0].node.gpu_error
