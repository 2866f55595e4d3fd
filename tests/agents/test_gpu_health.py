"""Pre-failure GPU signals, partial failure and hung NVML calls, through the real sampler.

The simulated driver is handed to ``GpuSampler`` exactly where the ``pynvml`` module goes,
so every NVML call below is the one the agent makes on a GPU node.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml

from agents.commands import CommandExecutor
from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.gpu.sim_model import SimGpuModel
from agents.gpu_health import pcie_degraded
from agents.sampler import GpuSampler
from trainguard.wire import GpuSample, SetPowerLimit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sim(faults: str = "", gpus: int = 4, **kw: object) -> tuple[SimNvml, Clock]:
    clock = Clock()
    api = SimNvml(gpu_count=gpus, clock=clock, faults=parse_fault_specs(faults), **kw)  # type: ignore[arg-type]
    api.nvmlInit()
    return api, clock


def test_memory_signals_by_location_remap_and_aggregate() -> None:
    api, clock = sim(
        "kind=ecc,gpu=1,at=5,corrected=3,location=sram;"
        "kind=ecc,gpu=1,at=5,uncorrected=2;"
        "kind=remap,gpu=1,at=5,correctable=1,uncorrectable=2,pending=1"
    )
    sampler = GpuSampler(api)
    sampler.open()
    before = sampler.sample()[1]
    assert before.remapped_rows_uncorrectable == 0 and before.row_remap_pending is False
    assert before.retired_pages_dbe is None  # an H100 remaps rows, it does not retire pages
    clock.t += 6
    g = sampler.sample()[1]
    by = {(c.location, c.counter): (c.corrected, c.uncorrected) for c in g.ecc_locations}
    assert by == {
        ("dram", "volatile"): (0, 2),
        ("dram", "aggregate"): (0, 2),
        ("sram", "volatile"): (3, 0),
        ("sram", "aggregate"): (3, 0),
    }  # l1/l2/register file answer NOT_SUPPORTED on this board and are not listed
    assert (g.ecc_corrected_total, g.ecc_uncorrected_total) == (3, 2)
    assert (g.ecc_corrected_aggregate_total, g.ecc_uncorrected_aggregate_total) == (3, 2)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (1, 2)
    assert g.row_remap_pending is True and g.row_remap_failed is False


def test_a_board_with_page_retirement_reports_retired_pages() -> None:
    model = SimGpuModel(name="Tesla V100-SXM2-32GB", row_remapping=False, page_retirement=True)
    api, clock = sim("kind=retire,gpu=0,at=1,sbe=2,dbe=1,pending=1", model=model)
    sampler = GpuSampler(api)
    sampler.open()
    clock.t += 2
    g = sampler.sample()[0]
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (2, 1, True)
    assert g.remapped_rows_correctable is None and g.row_remap_failed is None


def test_nvlink_per_link_counters_and_a_link_going_down_is_one_event() -> None:
    api, clock = sim(
        "kind=nvlink,gpu=0,at=2,link=3,crc=40,replay=2,recovery=1;"
        "kind=nvlink,gpu=0,at=4,link=5,down=1"
    )
    sampler = GpuSampler(api, clock=clock)
    sampler.open()
    first = sampler.sample()[0]
    # Healthy links are counted, not listed (they would triple the report's size).
    assert first.nvlink_active_count == 18 and first.nvlinks == []
    clock.t += 3
    g = sampler.sample()[0]
    (link3,) = g.nvlinks
    assert link3.link == 3 and link3.active and g.nvlink_active_count == 18
    assert (link3.crc_errors_total, link3.replay_errors_total, link3.recovery_errors_total) == (
        40,
        2,
        1,
    )
    assert g.nvlink_crc_errors_total == 40 and g.nvlink_replay_errors_total == 2
    assert sampler.take_events() == []
    clock.t += 2
    down = sampler.sample()[0]
    assert [(n.link, n.active) for n in down.nvlinks] == [(3, True), (5, False)]
    assert down.nvlink_active_count == 17
    sampler.sample()
    events = sampler.take_events()
    assert [(e.kind, e.gpu_index, e.port) for e in events] == [("nvlink_down", 0, 5)]
    assert events[0].time_unix_s == clock.t


def test_pcie_replays_width_drop_fabric_and_mig() -> None:
    api, clock = sim(
        "kind=pcie,gpu=2,at=1,width=8,replay=12;kind=fabric,gpu=3,at=0,state=2,status=0",
        utilization_pct=90,
    )
    sampler = GpuSampler(api, clock=clock)
    sampler.open()
    start = sampler.sample()
    assert start[0].fabric_state == "completed" and start[0].fabric_status == 0
    assert start[3].fabric_state == "in_progress"
    assert start[0].mig_mode is False and start[0].mig_mode_pending is False
    assert start[2].pcie_replay_total == 0
    clock.t += 2
    g = sampler.sample()[2]
    assert g.pcie_link_width == 8 and g.pcie_link_width_max == 16 and g.pcie_replay_total == 12
    events = sampler.take_events()
    assert [(e.kind, e.gpu_index) for e in events] == [("pcie_link_degraded", 2)]
    assert events[0].detail == "PCIe link width x8 of x16"


def test_an_idle_gpu_at_a_lower_pcie_generation_is_not_degraded() -> None:
    idle = GpuSample(
        index=0, pcie_link_gen=1, pcie_link_gen_max=5, pcie_link_width=16,
        pcie_link_width_max=16, utilization_gpu_pct=0,
    )  # fmt: skip
    assert pcie_degraded(idle) == ""
    busy = idle.model_copy(update={"utilization_gpu_pct": 95.0})
    assert pcie_degraded(busy) == "PCIe link Gen1 of Gen5 while 95% busy"


def test_nvml_raising_for_one_gpu_still_reports_the_others() -> None:
    api, clock = sim(f"kind=nvml_error,gpu=1,at=1,code={pynvml.NVML_ERROR_UNKNOWN}")
    sampler = GpuSampler(api)
    sampler.open()
    clock.t += 2
    samples = sampler.sample()
    assert [s.index for s in samples] == [0, 1, 2, 3]
    bad = samples[1]
    assert bad.power_w is None and bad.temperature_c is None and not bad.lost
    assert bad.error == "power: Unknown Error"
    for good in (samples[0], samples[2], samples[3]):
        assert good.power_w is not None and good.error == "" and not good.unknown


def test_a_hung_nvml_call_marks_that_gpu_unknown_and_sampling_goes_on() -> None:
    api = SimNvml(gpu_count=4, faults=parse_fault_specs("kind=hang,gpu=2"))  # from the start
    api.nvmlInit()
    sampler = GpuSampler(api, timeout_s=0.2)
    inventory = sampler.open()
    assert inventory[2].uuid == "gpu-2-unknown" and inventory[1].uuid.startswith("GPU-")
    try:
        t0 = time.monotonic()
        first = sampler.sample()
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert first[2].unknown and "did not answer within 0.2 s" in first[2].error
        assert all(s.power_w is not None for i, s in enumerate(first) if i != 2)
        # The stuck call is still inside the driver: the next tick does not wait for it.
        t0 = time.monotonic()
        second = sampler.sample()
        assert time.monotonic() - t0 < 0.15
        assert second[2].unknown and [s.unknown for s in second].count(True) == 1
        kinds = [e.kind for e in sampler.take_events()]
        assert kinds == ["gpu_unknown"]  # once, not once per tick
        api.release_hangs()  # the driver answers again
        deadline = time.monotonic() + 5
        while sampler.sample()[2].unknown:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        api.release_hangs()
        sampler.close()


def test_a_gpu_that_hung_at_start_gets_its_real_identity_once_it_answers() -> None:
    api = SimNvml(gpu_count=2, faults=parse_fault_specs("kind=hang,gpu=1,duration=0.4"))
    api.nvmlInit()
    sampler = GpuSampler(api, timeout_s=0.05)
    try:
        assert [g.uuid for g in sampler.open()][1] == "gpu-1-unknown"
        assert sampler.sample()[1].unknown and sampler.inventory_version == 0
        deadline = time.monotonic() + 5
        while sampler.inventory_version == 0:
            assert time.monotonic() < deadline
            sampler.sample()
            time.sleep(0.02)
        real = api.nvmlDeviceGetUUID(api.nvmlDeviceGetHandleByIndex(1))
        assert sampler.inventory[1].uuid == real and len(sampler.inventory[1].uuid) > 20
        later = sampler.sample()[1]
        assert not later.unknown and later.uuid == real and later.power_w is not None
    finally:
        api.release_hangs()
        sampler.close()


def test_a_gpu_that_fails_at_start_is_reported_and_the_agent_starts() -> None:
    # GPU 1 fell off the bus before the agent started: nvmlDeviceGetHandleByIndex refuses.
    api = SimNvml(gpu_count=3, faults=parse_fault_specs("kind=lost,gpu=1;kind=nvml_error,gpu=2"))
    api.nvmlInit()
    sampler = GpuSampler(api, timeout_s=0.5)
    try:
        inventory = sampler.open()
        assert [g.uuid.startswith("GPU-") for g in inventory] == [True, False, False]
        assert sampler.handles[1] is None and sampler.handles[2] is None
        samples = sampler.sample()
        assert samples[0].power_w is not None and not samples[0].unknown
        assert samples[1].lost and sampler.lost == {1}
        assert samples[2].unknown and samples[2].error == "no inventory: Unknown Error"
        acks: list[Any] = []
        executor = CommandExecutor(api, sampler.handles, relay=lambda _c: 0, on_ack=acks.append)
        ack = executor.execute(SetPowerLimit(id="c1", gpu_index=1, limit_w=300))
        assert ack.status == "failed"
        assert ack.reason == "GPU 1 has not answered NVML since the agent started"
    finally:
        sampler.close()
