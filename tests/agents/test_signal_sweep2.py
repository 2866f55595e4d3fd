"""Acceptance sweep of the node agent's signals, part 2: bigger and stranger nodes.

As in ``test_signal_sweep.py``: the simulated NVML backend (pynvml's names, units and error
classes) and sysfs trees laid out as the kernel does; nothing here ran on real hardware.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agents.metrics import AgentCollector, MetricsSource
from agents.nics import NicMonitor
from agents.preflight import _nic_checks
from agents.sampler import GpuSampler
from agents.stats import AgentStats
from agents.xid_events import XidWatcher
from tests.agents.sysfs_tree import SysfsTree
from tests.agents.test_signal_sweep import Override, sim
from trainguard.wire import MAX_REPORT_BYTES, NicPortSample, NodeSample, Report

# ---------------------------------------------------------------------- XID storms


def _xid(watcher: XidWatcher, handle: Any, code: int) -> None:
    """One critical XID as NVML's event set delivers it, handled by the watcher."""
    watcher._record(
        SimpleNamespace(
            device=handle, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=code
        )
    )


def test_a_fatal_xid_is_not_pushed_out_by_a_storm_of_another_code() -> None:
    """XID 79 (off the bus) and then 1,500 XID 13 on the same GPU before the next sample:
    the 79 used to be the oldest of 1,501 and dropped, so the controller never saw the
    fatal code. Every code stays listed, and the newest of a code with events left out says
    how many came."""
    api, clock = sim()
    handle = api.nvmlDeviceGetHandleByIndex(0)
    watcher = XidWatcher(api, [handle], clock=clock)
    _xid(watcher, handle, 79)
    for _ in range(1500):
        clock.t += 0.001
        _xid(watcher, handle, 13)
    events = watcher.drain(0)
    assert len(events) == 1024 and events[0].code == 79
    assert events[-1].code == 13 and events[-1].time_unix_s == pytest.approx(clock.t)
    assert "1500 XID 13 on this GPU since the last sample, 477 not listed" in events[-1].detail
    assert watcher.dropped_total == 1501 - 1024
    # A small drain still names both codes, the newest event last.
    for code in (79, 13, 13, 13):
        clock.t += 0.001
        _xid(watcher, handle, code)
    small = watcher.drain(0, limit=2)
    assert [e.code for e in small] == [79, 13] and "3 XID 13" in small[1].detail
    assert watcher.drain(0) == []


def test_an_xid_storm_on_every_gpu_of_a_64_gpu_node_keeps_the_report_under_the_cap(
    agent_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """512 XIDs on each of 64 GPUs between two samples, twice before a report: the report
    used to carry every one (about 90 bytes each, 6 MB), past the wire's 4 MiB,
    and the controller refused it whole, samples and all. It stays under the cap, and each
    GPU's sample still names every code seen (the fatal 79 first), the newest event, and
    how many were left out."""
    caplog.set_level(logging.ERROR, logger="agents.xid_events")  # one line per XID otherwise
    # A generous NVML timeout: 64 sampling threads on a busy test machine are slow, not hung.
    agent = agent_factory(gpus="sim:64", nvml_timeout_s=30)
    assert agent.xids is not None
    handles = agent.sampler.handles
    assert len(handles) == 64
    # The 16th GPU on had a 3-digit PCI bus (0x108) in the simulator: no inventory at all.
    assert len({g.pci_bus_id for g in agent.identity.gpus}) == 64
    samples = []
    for round_ in range(2):
        for handle in handles:
            if round_ == 0:
                _xid(agent.xids, handle, 79)
            for i in range(512):
                _xid(agent.xids, handle, 13 if i % 2 else 31)
        samples.append(agent.sample())
    seq = agent.flush()
    data = agent.spool.path_for(seq).read_bytes()
    assert len(data) < MAX_REPORT_BYTES
    report = Report.model_validate_json(data)
    assert len(report.samples) == 2
    first = report.samples[0]
    for gpu in first.gpus:
        codes = [e.code for e in gpu.xid_events]
        assert codes[0] == 79 and {13, 31} <= set(codes), gpu.index
        assert gpu.uuid and gpu.error == "", gpu.index  # every GPU has its inventory
        # Alternating 31, 13: the last one was a 13, and it carries the count of its code.
        assert "256 XID 13 on this GPU since the last sample" in gpu.xid_events[-1].detail
    for sample in report.samples[1:]:
        for gpu in sample.gpus:
            assert {e.code for e in gpu.xid_events} == {13, 31}, gpu.index
            assert any("not listed" in e.detail for e in gpu.xid_events)


# ---------------------------------------------------------------------- RDMA ports

#: Every ``state`` the kernel prints (drivers/infiniband/core/sysfs.c, ``enum ib_port_state``;
#: past the table it prints UNKNOWN) and whether the port passes traffic.
IB_STATES = [
    ("0: NOP", False),
    ("1: DOWN", False),
    ("2: INIT", False),
    ("3: ARMED", False),
    ("4: ACTIVE", True),
    ("5: ACTIVE_DEFER", True),
    ("6: UNKNOWN", False),
]
#: Every ``phys_state`` it prints (``ib_port_phys_state_str``), and the name the agent keeps.
IB_PHYS_STATES = {
    "1: Sleep": "Sleep",
    "2: Polling": "Polling",
    "3: Disabled": "Disabled",
    "4: PortConfigurationTraining": "PortConfigurationTraining",
    "5: LinkUp": "LinkUp",
    "6: LinkErrorRecovery": "LinkErrorRecovery",
    "7: Phy Test": "Phy Test",
    "8: <unknown>": "<unknown>",
}


@pytest.fixture
def tree(tmp_path: Path) -> SysfsTree:
    return SysfsTree(tmp_path / "sys").build()


def _port_up_gauge(ports: list[NicPortSample]) -> dict[str, float]:
    source = MetricsSource(
        hostname="n",
        inventory=[],
        stats=AgentStats(),
        spool_stats=lambda: (0, 0),
        spool_dropped_total=lambda: 0,
        latest=NodeSample(time_unix_s=1.0, nics=ports),
    )
    family = next(m for m in AgentCollector(source).collect() if m.name == "trainguard_nic_port_up")
    return {s.labels["device"]: s.value for s in family.samples}


def test_every_ib_port_state_is_classified_as_the_kernel_means_it(tree: SysfsTree) -> None:
    """``5: ACTIVE_DEFER`` is an active port (a state change the subnet manager deferred):
    it used to raise ``nic_port_down`` (the controller degrades the node for it), read 0 on
    ``trainguard_nic_port_up`` and fail the ``nic_port`` preflight check."""
    mon = NicMonitor(tree.root)
    mon.sample(0.0)
    t = 0.0
    for text, up in IB_STATES:
        t += 1
        tree.set_port("mlx5_0", 1, state=text, phys_state="5: LinkUp")
        ports, events = mon.sample(t)
        assert [e.kind for e in events] == ([] if up else ["nic_port_down"]), text
        assert _port_up_gauge(ports)["mlx5_0"] == (1.0 if up else 0.0), text
        status = {c.target: c.status for c in _nic_checks(ports, None)}
        assert status["mlx5_0/1"] == ("pass" if up else "fail"), text
        t += 1
        tree.set_port("mlx5_0", 1, state="4: ACTIVE", phys_state="5: LinkUp")
        assert [e.kind for e in mon.sample(t)[1]] == ([] if up else ["nic_port_up"]), text
    for text, name in IB_PHYS_STATES.items():
        tree.set_port("mlx5_1", 1, state="4: ACTIVE", phys_state=text)
        (port,) = [p for p in mon.read_all() if p.device == "mlx5_1"]
        assert port.phys_state == name


def _plain_device(tree: SysfsTree, name: str, physfn: str = "") -> Path:
    """An RDMA device with one ACTIVE port; an SR-IOV VF when ``physfn`` names its PF."""
    dev = tree.root / "class" / "infiniband" / name
    tree.set_port(name, 1, state="4: ACTIVE", phys_state="5: LinkUp")
    (dev / "device").mkdir(parents=True, exist_ok=True)
    if physfn:
        (dev / "device" / "physfn").symlink_to(f"../../{physfn}")
    return dev


def test_a_nic_or_netdev_name_that_is_not_utf8_costs_nothing(tree: SysfsTree) -> None:
    """Linux lets a netdev name hold any byte but ``/``, ``:`` and blanks. A name that is
    not UTF-8 used to sink the node's whole NIC inventory (the wire refuses Python's
    surrogates), leave its port out of every sample and, once gone, fail every RDMA tick."""
    function = tree.root / "class" / "infiniband" / "mlx5_0" / "device"
    (function / "net" / "ib\udcff0").mkdir(parents=True)
    (function / "net" / "ibp25s0").rmdir()
    _plain_device(tree, "mlx5_\udcfe")
    mon = NicMonitor(tree.root)
    inventory = {(n.device, n.netdev) for n in mon.inventory({})}
    assert {("mlx5_0", "ib\\xff0"), ("mlx5_\\xfe", "")} <= inventory
    assert "mlx5_\\xfe" in [p.device for p in mon.sample(0.0)[0]]
    tree.set_port("mlx5_\udcfe", 1, state="1: DOWN", phys_state="3: Disabled")
    assert [(e.kind, e.device) for e in mon.sample(1.0)[1]] == [("nic_port_down", "mlx5_\\xfe")]
    shutil.rmtree(tree.root / "class" / "infiniband" / "mlx5_\udcfe")
    assert [(e.kind, e.device) for e in mon.sample(2.0)[1]] == [("nic_gone", "mlx5_\\xfe")]


def test_hundreds_of_vfs_never_push_a_physical_port_out_of_the_report(
    tree: SysfsTree, agent_factory: Any
) -> None:
    """300 SR-IOV VFs (``mlx5_10`` .. ``mlx5_309``, each with ``device/physfn``) beside the
    physical ``mlx5_0``, ``mlx5_1`` and ``mlx5_9``: a report carries 256 ports at most, and
    sorted as text ``mlx5_9`` came after ``mlx5_299``, so a physical port was cut, and its
    going down never reported. Physical functions come first, in natural order."""
    _plain_device(tree, "mlx5_9")
    for i in range(10, 310):
        _plain_device(tree, f"mlx5_{i}", physfn="mlx5_0")
    agent = agent_factory(sysfs_root=tree.root)
    names = [p.device for p in agent.sample().nics]
    assert len(names) == 256 and names[:4] == ["mlx5_0", "mlx5_1", "mlx5_9", "mlx5_10"]
    assert [n.device for n in agent.identity.nics][:3] == ["mlx5_0", "mlx5_1", "mlx5_9"]
    tree.set_port("mlx5_9", 1, state="1: DOWN", phys_state="3: Disabled")
    sample = agent.sample()
    assert [(e.kind, e.device) for e in sample.events] == [("nic_port_down", "mlx5_9")]


# ---------------------------------------------------------------------- GPUs


def test_a_clock_of_0_mhz_is_no_reading() -> None:
    """NVML answering 0 MHz (a clock domain it could not read) used to be shipped as a
    reading: the node's average clock on the dashboard dropped, ``trainguard_gpu_sm_clock
    _hertz`` read 0. It is null and named in the sample's error, as a 0 °C temperature is;
    the other GPU, and the next sample that reads a clock, are untouched."""
    api, clock = sim()
    over = Override(api)
    real = api.nvmlDeviceGetClockInfo
    zero_on = {1}
    over.fns["nvmlDeviceGetClockInfo"] = lambda h, which: (
        0 if api.nvmlDeviceGetIndex(h) in zero_on else real(h, which)
    )
    sampler = GpuSampler(over, clock=clock)
    sampler.open()
    gpu0, gpu1 = sampler.sample()
    assert gpu0.sm_clock_mhz and gpu0.mem_clock_mhz and gpu0.error == ""
    assert (gpu1.sm_clock_mhz, gpu1.mem_clock_mhz) == (None, None)
    assert "sm_clock_mhz=0" in gpu1.error and gpu1.power_w and not gpu1.unreachable
    zero_on.clear()
    clock.t += 1
    assert sampler.sample()[1].sm_clock_mhz


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_ERROR_GPU_IS_LOST]
)
def test_one_gpu_failing_mid_sample_costs_that_gpu_only(code: int) -> None:
    """GPU 1's temperature read fails after its power was read (the driver answers UNKNOWN,
    TIMEOUT or GPU_IS_LOST in the middle of a sample). UNKNOWN and TIMEOUT cost that field
    (null, named in the error; one failed read is not an unreachable GPU); GPU_IS_LOST makes
    the GPU ``lost`` (one urgent callback) and the next sample that reads it clears it."""
    api, clock = sim()
    over = Override(api)
    real = api.nvmlDeviceGetTemperature
    failing = {1}

    def temperature(h: Any, sensor: int) -> Any:
        if api.nvmlDeviceGetIndex(h) in failing:
            raise pynvml.NVMLError(code)
        return real(h, sensor)

    over.fns["nvmlDeviceGetTemperature"] = temperature
    lost: list[int] = []
    sampler = GpuSampler(over, clock=clock, on_lost=lost.append, unreachable_after=2)
    sampler.open()
    for _ in range(3):
        clock.t += 1
        gpu0, gpu1 = sampler.sample()
        assert gpu0.temperature_c and gpu0.error == "" and not gpu0.lost
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            assert gpu1.lost and gpu1.power_w is None
        else:
            assert gpu1.temperature_c is None and gpu1.power_w and not gpu1.unreachable
            assert gpu1.error == f"temperature: {pynvml.NVMLError(code)}"
    assert lost == ([1] if code == pynvml.NVML_ERROR_GPU_IS_LOST else [])
    failing.clear()
    clock.t += 1
    back = sampler.sample()[1]
    assert back.temperature_c and not back.lost and back.error == ""
