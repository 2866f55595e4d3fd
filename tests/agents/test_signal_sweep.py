"""Acceptance sweep of the node agent's hardware signals: realistic cases a GPU node shows.

Everything runs against the simulated NVML backend (pynvml's names, units and error classes)
and sysfs trees laid out as the kernel does (``tests/agents/sysfs_tree.py``); nothing here
ran on real GPUs or NICs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.clocks_load import LoadSettings, LoadTarget, _Run, _Sampler, _status
from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.nics import NicMonitor
from agents.sampler import GpuSampler
from agents.xid_events import XidWatcher
from tests.agents.sysfs_tree import SysfsTree


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Override:
    """The simulated driver with some functions replaced (per call, by name)."""

    def __init__(self, api: SimNvml) -> None:
        self._api = api
        self.fns: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Any:
        if name in self.fns:
            return self.fns[name]
        return getattr(self._api, name)


def sim(faults: str = "", gpus: int = 2, **kw: Any) -> tuple[SimNvml, Clock]:
    clock = Clock()
    api = SimNvml(gpu_count=gpus, clock=clock, faults=parse_fault_specs(faults), **kw)
    api.nvmlInit()
    return api, clock


def nvml_error(code: int) -> Callable[..., Any]:
    def fail(*_: Any) -> Any:
        raise pynvml.NVMLError(code)

    return fail


@pytest.fixture
def tree(tmp_path: Path) -> SysfsTree:
    return SysfsTree(tmp_path / "sys").build()


# ---------------------------------------------------------------------- NICs


def test_a_nic_gone_and_back_is_not_compared_across_the_gap(tree: SysfsTree) -> None:
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    tree.set_counter("mlx5_1", 1, "symbol_error", 5)
    assert mon.sample(0.0)[1] == []
    tree.remove_nic("mlx5_1")
    assert [e.kind for e in mon.sample(1.0)[1]] == ["nic_gone"]
    tree.add_nic("mlx5_1")
    # The HCA's counters live in its firmware: back after a driver rebind they read higher.
    tree.set_counter("mlx5_1", 1, "symbol_error", 40)
    assert [e.kind for e in mon.sample(2.0)[1]] == ["nic_back"]
    tree.set_counter("mlx5_1", 1, "symbol_error", 50)
    assert [(e.kind, e.delta) for e in mon.sample(3.0)[1]] == [("nic_errors_rising", 10)]


def test_a_port_unreadable_for_a_tick_keeps_its_state_but_not_its_counters(
    tree: SysfsTree,
) -> None:
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    tree.set_counter("mlx5_0", 1, "symbol_error", 5)
    tree.set_counter("mlx5_0", 1, "link_downed", 1)
    assert mon.sample(0.0)[1] == []
    state = tree.port_dir("mlx5_0", 1) / "state"
    state.unlink()  # mid-rebind: the port directory is there, its files are not yet
    ports, events = mon.sample(1.0)
    assert events == [] and [p.device for p in ports] == ["mlx5_1"]
    # Back with higher counters: no flap and no rise across the gap.
    tree.set_port("mlx5_0", 1, state="4: ACTIVE", phys_state="5: LinkUp")
    tree.set_counter("mlx5_0", 1, "symbol_error", 60)
    tree.set_counter("mlx5_0", 1, "link_downed", 4)
    assert mon.sample(2.0)[1] == []
    # Gone for a tick again and back DOWN: the down is still seen (the state is kept).
    state.unlink()
    mon.sample(3.0)
    tree.set_port("mlx5_0", 1, state="1: DOWN", phys_state="3: Disabled")
    assert [(e.kind, e.counter) for e in mon.sample(4.0)[1]] == [("nic_port_down", "")]


# ---------------------------------------------------------------------- GPUs


def test_a_clock_event_mask_with_bit_63_keeps_the_known_bits() -> None:
    """Older NVML headers define ``nvmlClocksThrottleReasonUnknown`` = 0x8000000000000000;
    a mask with it set is past the wire's signed 64-bit column. Bits the agent does not
    know (0x200) travel in the mask; bit 63 is dropped instead of the whole mask."""
    api, clock = sim()
    over = Override(api)
    over.fns["nvmlDeviceGetCurrentClocksEventReasons"] = lambda h: (1 << 63) | 0x4 | 0x200
    sampler = GpuSampler(over, clock=clock)
    sampler.open()
    s = sampler.sample()[0]
    assert s.throttle_reasons_mask == 0x204
    assert [r.value for r in s.throttle_reasons] == ["sw_power_cap"]
    assert s.error == ""


def test_a_pcie_generation_drop_is_not_restored_by_an_idle_phase_or_a_failed_read() -> None:
    """Gen4 of Gen5 while busy is degraded; the communication or checkpoint phase of a job
    (utilization under 50 %) or one failed read says nothing either way, so no
    ``pcie_link_restored``/``pcie_link_degraded`` pair per phase."""
    api, clock = sim("kind=pcie,gpu=0,at=0,gen=4")
    over = Override(api)
    util = {"pct": 90}
    over.fns["nvmlDeviceGetUtilizationRates"] = lambda h: pynvml.c_nvmlUtilization_t(
        gpu=util["pct"], memory=10
    )
    sampler = GpuSampler(over, clock=clock)
    sampler.open()
    seen = []
    for pct in (90, 20, 90, 20, 90):
        util["pct"] = pct
        clock.t += 1
        sampler.sample()
        seen += [(e.kind, e.gpu_index) for e in sampler.take_events()]
    assert seen == [("pcie_link_degraded", 0)]
    # A tick whose width read fails is no evidence of a restored link either.
    over.fns["nvmlDeviceGetCurrPcieLinkWidth"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)
    clock.t += 1
    sampler.sample()
    assert sampler.take_events() == []
    del over.fns["nvmlDeviceGetCurrPcieLinkWidth"]
    # The link retrains to Gen5: restored, once.
    over.fns["nvmlDeviceGetCurrPcieLinkGeneration"] = lambda h: 5
    clock.t += 1
    sampler.sample()
    assert [(e.kind, e.gpu_index) for e in sampler.take_events()] == [("pcie_link_restored", 0)]


class _RunningLoad:
    """A load process that runs for ``polls`` polls of the load sampler, then ends the
    sampler's loop (so ``_Sampler.run`` runs on this thread, without a subprocess)."""

    returncode = 0

    def __init__(self, stop: Any, polls: int = 6) -> None:
        self._stop, self._left = stop, polls

    def poll(self) -> int | None:
        self._left -= 1
        if self._left <= 0:
            self._stop.set()
        return None


def _load_check(over: Override, api: SimNvml) -> tuple[str, str]:
    """The clocks_load verdict for GPU 0 after a few reads of the load sampler."""
    handle = api.nvmlDeviceGetHandleByIndex(0)
    run = _Run(LoadTarget(index=0, uuid="u", handle=handle, sm_clock_max_mhz=1980))
    sampler = _Sampler(over, [run], 0.0)
    run.proc = _RunningLoad(sampler.stop)  # type: ignore[assignment]
    sampler.run()
    return _status(run, LoadSettings(command=("load",)), False)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        ("nvmlDeviceGetCurrentClocksEventReasons", ("pass", "reasons: not reported by this GPU")),
        ("nvmlDeviceGetUtilizationRates", ("skip", "does not report this GPU's utilization")),
        ("nvmlDeviceGetClockInfo", ("skip", "does not report this GPU's SM clock")),
    ],
)
def test_a_board_that_does_not_report_a_reading_is_never_failed_by_clocks_load(
    fn: str, expected: tuple[str, str]
) -> None:
    """NOT_SUPPORTED (a vGPU, a MIG-enabled GPU) is an answer, not a GPU that stopped
    answering: it used to fail ``clocks_load`` with "NVML did not answer during the load",
    and a failed preflight cordons the node."""
    api, _ = sim(utilization_pct=95)
    over = Override(api)
    over.fns[fn] = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    status, detail = _load_check(over, api)
    assert (status, expected[1] in detail) == (expected[0], True), detail
    # Any other error still fails it: NVML did not answer.
    over.fns[fn] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)
    status, detail = _load_check(over, api)
    assert (status, detail) == ("fail", "NVML did not answer during the load (Unknown Error)")


# ---------------------------------------------------------------------- checked, fine


def test_an_xid_storm_keeps_the_newest_per_gpu_and_counts_the_rest() -> None:
    """1,500 XIDs on GPU 1 and one XID 79 on GPU 0 in the same instant: GPU 1's sample
    carries the newest 1,024 (the wire's cap), the rest are counted as dropped, and GPU 0's
    XID is not crowded out. The watcher's loop runs on this thread until the set is empty."""
    specs = ";".join(f"kind=xid,gpu=1,code={13 + i % 2},at=1" for i in range(1500))
    api, clock = sim(specs + ";kind=xid,gpu=0,code=79,at=1")
    watcher = XidWatcher(api, [api.nvmlDeviceGetHandleByIndex(i) for i in range(2)])
    wait = api.nvmlEventSetWait_v2

    def wait_until_empty(event_set: Any, timeout_ms: int) -> Any:
        try:
            return wait(event_set, 0)
        except pynvml.NVMLError:
            watcher._stop.set()  # the set is drained: end the loop
            raise

    over = Override(api)
    over.fns["nvmlEventSetWait_v2"] = wait_until_empty
    watcher._api = over
    # start() without its thread: the event set and the registrations, then the loop here.
    watcher._event_set = api.nvmlEventSetCreate()
    assert watcher._register_pending(at_start=True) == [0, 1]
    clock.t += 2
    watcher._run()
    sampler = GpuSampler(api, clock=clock, xid_source=watcher.drain)
    sampler.open()
    gpu0, gpu1 = sampler.sample()
    assert [x.code for x in gpu0.xid_events] == [79]
    assert len(gpu1.xid_events) == 1024 and watcher.dropped_total == 1500 - 1024
    assert sampler.sample()[1].xid_events == []  # drained once, never sent twice


def test_an_energy_counter_reset_and_a_gpu_lost_mid_run() -> None:
    """A driver reload restarts the energy counter (mJ): the sample carries the new, lower
    total without an error (rates are the reader's to compute across the reset). A GPU that
    falls off the bus is ``lost`` once (one urgent callback), the other keeps sampling."""
    api, clock = sim("kind=reset,gpu=0,at=50;kind=lost,gpu=1,at=60")
    lost: list[int] = []
    sampler = GpuSampler(api, clock=clock, on_lost=lost.append)
    sampler.open()
    clock.t += 40
    before = sampler.sample()[0]
    clock.t += 15
    after = sampler.sample()[0]
    assert before.energy_j is not None and after.energy_j is not None
    assert after.energy_j < before.energy_j and after.error == ""
    assert after.power_w is not None and 50 < after.power_w < 1000  # mW -> W
    clock.t += 10
    for _ in range(3):
        gpu0, gpu1 = sampler.sample()
        assert gpu1.lost and gpu1.power_w is None and not gpu0.lost and gpu0.power_w
    assert lost == [1]


def test_some_gpus_not_supporting_some_fields_is_an_answer_not_unreachable() -> None:
    """GPU 1 (a consumer-like board) answers NOT_SUPPORTED for energy, ECC and its clock
    event reasons: those fields are null, silently, and it never turns unreachable."""
    api, clock = sim(
        unsupported_by_gpu={
            1: [
                "nvmlDeviceGetTotalEnergyConsumption",
                "nvmlDeviceGetTotalEccErrors",
                "nvmlDeviceGetCurrentClocksEventReasons",
            ]
        }
    )
    sampler = GpuSampler(api, clock=clock, unreachable_after=2)
    sampler.open()
    for _ in range(4):
        clock.t += 1
        gpu0, gpu1 = sampler.sample()
    assert gpu0.energy_j is not None and gpu0.ecc_corrected_total == 0
    assert gpu1.energy_j is None and gpu1.ecc_corrected_total is None
    assert gpu1.power_w is not None and gpu1.error == "" and not gpu1.unreachable


def test_a_roce_port_and_an_ib_port_that_is_down(tree: SysfsTree) -> None:
    """RoCE: ``link_layer`` Ethernet, the same counters/ and hw_counters/ folders; the
    kernel's strings are parsed as it writes them, a DOWN port at start is a reading (no
    event: nothing changed), and its coming up is one ``nic_port_up``."""
    port = tree.port_dir("mlx5_0", 1)
    (port / "link_layer").write_text("Ethernet\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    tree.set_counter("mlx5_0", 1, "np_ecn_marked_roce_packets", 77, hw=True)
    tree.set_port("mlx5_1", 1, state="1: DOWN", phys_state="2: Polling")
    (tree.port_dir("mlx5_1", 1) / "rate").write_text("10 Gb/sec (4X SDR)\n")
    mon = NicMonitor(tree.root)
    ports, events = mon.sample(0.0)
    assert events == []
    roce, ib = ports
    assert (roce.link_layer, roce.rate_gbps, roce.state) == ("Ethernet", 200.0, "ACTIVE")
    assert roce.counters["np_ecn_marked_roce_packets"] == 77
    assert (ib.state, ib.phys_state, ib.rate_gbps) == ("DOWN", "Polling", 10.0)
    tree.set_port("mlx5_1", 1, state="4: ACTIVE", phys_state="5: LinkUp")
    assert [(e.kind, e.device) for e in mon.sample(1.0)[1]] == [("nic_port_up", "mlx5_1")]


def test_counters_that_wrap_saturate_or_reset_raise_no_false_alarm(tree: SysfsTree) -> None:
    """A 32-bit ``port_xmit_data`` (4-byte words, HCAs without extended counters) going
    round is shipped as read, no rate is made of it here; an error counter that goes down
    (``perfquery -R``, a driver reload) starts a new window; one stuck at its 16-bit
    saturation value raises once, not every tick."""
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    tree.set_counter("mlx5_0", 1, "port_xmit_data", 2**32 - 5)
    tree.set_counter("mlx5_0", 1, "symbol_error", 65_530)
    assert mon.sample(0.0)[1] == []
    tree.set_counter("mlx5_0", 1, "port_xmit_data", 7)
    tree.set_counter("mlx5_0", 1, "symbol_error", 3)
    ports, events = mon.sample(1.0)
    assert events == [] and ports[0].counters["port_xmit_data"] == 7
    tree.set_counter("mlx5_0", 1, "symbol_error", 13)
    assert [(e.kind, e.delta) for e in mon.sample(2.0)[1]] == [("nic_errors_rising", 10)]
    tree.set_counter("mlx5_0", 1, "symbol_error", 65_535)
    assert mon.sample(3.0)[1] == []  # still the same episode
    for t in (4.0, 5.0, 90.0):
        assert mon.sample(t)[1] == []
