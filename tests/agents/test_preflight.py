"""Preflight checks through the real sampler (simulated driver) and a kernel-shaped sysfs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.clocks_load import run_preflight_with_load
from agents.daemon import Agent
from agents.gpu.backend import GpuBackend, NoGpus, open_backend
from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.nics import NicMonitor
from agents.preflight import summary
from agents.sampler import GpuSampler
from agents.settings import load_settings
from tests.agents.agents_testkit import TOKEN, FakeController, Running
from tests.agents.sysfs_tree import SysfsTree


@pytest.fixture
def tree(tmp_path: Path) -> SysfsTree:
    return SysfsTree(tmp_path / "sys").build()


def _run(
    faults: str,
    tree: SysfsTree,
    timeout_s: float = 2.0,
    expected_nic_rate_gbps: float | None = None,
    load_s: float = 0,
    load_dir: Path | None = None,
) -> dict[tuple[str, str], tuple[str, str]]:
    api = SimNvml(gpu_count=4, faults=parse_fault_specs(faults), load_dir=load_dir)
    api.nvmlInit()
    backend = GpuBackend(api=api, kind="sim", driver_version="sim")
    sampler = GpuSampler(api, timeout_s=timeout_s)
    sampler.open()
    try:
        checks = run_preflight_with_load(
            backend,
            sampler,
            NicMonitor(tree.root),
            load_s=load_s,
            expected_nic_rate_gbps=expected_nic_rate_gbps,
        )
    finally:
        sampler.close()
        api.nvmlShutdown()  # also ends a simulated hang
    return {(c.target, c.name): (c.status, c.reason) for c in checks}


def test_a_healthy_simulated_node_passes_and_says_it_is_simulated(tree: SysfsTree) -> None:
    got = _run("", tree)
    assert got[("node", "nvml")] == ("pass", "simulated GPUs (sim): not real hardware")
    assert {status for status, _ in got.values()} == {"pass", "skip"}
    assert got[("gpu0", "nvlink")] == ("pass", "18 links up")
    assert got[("gpu2", "pcie")] == ("pass", "x16 Gen5")
    assert got[("gpu1", "memory_repair")] == ("pass", "0 rows remapped, none pending")
    assert got[("gpu0", "clocks_load")] == ("skip", "no load generated: --load-s 0")
    assert got[("mlx5_0/1", "nic_port")] == ("pass", "ACTIVE 400 Gb/s")


def test_the_local_preflight_loads_the_gpus_and_judges_them(
    tree: SysfsTree, tmp_path: Path
) -> None:
    got = _run("kind=slowdown,gpu=1,mhz=700", tree, load_s=0.5, load_dir=tmp_path)
    loaded = {t: v for (t, name), v in got.items() if name == "clocks_load"}
    assert {t: status for t, (status, _) in loaded.items()} == {
        "gpu0": "pass", "gpu1": "fail", "gpu2": "pass", "gpu3": "pass"
    }  # fmt: skip
    assert loaded["gpu1"][1].startswith("SM clock 700 MHz under load (")
    assert got[("gpu1", "nvml_sanity")][0] == "pass"  # the idle checks ran as well


def test_each_failure_is_named_with_its_reason(tree: SysfsTree) -> None:
    faults = (
        "kind=ecc,gpu=0,uncorrected=1;kind=remap,gpu=1,pending=1;"
        "kind=nvlink,gpu=2,link=3,down=1;kind=pcie,gpu=3,width=8"
    )
    tree.set_port("mlx5_1", 1, state="1: DOWN", phys_state="3: Disabled")
    got = _run(faults, tree)
    failed = {k: reason for k, (status, reason) in got.items() if status == "fail"}
    assert failed == {
        ("gpu0", "ecc"): "1 uncorrectable ECC errors since driver load",
        ("gpu1", "memory_repair"): "row remap pending: reset the GPU first",
        ("gpu2", "nvlink"): "NVLink 3 down",
        ("gpu3", "pcie"): "PCIe link x8 of x16",
        ("mlx5_1/1", "nic_port"): "DOWN (Disabled)",
    }


def test_a_slow_port_fails_against_the_expected_rate_or_its_peers(tree: SysfsTree) -> None:
    (tree.port_dir("mlx5_1", 1) / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert _run("", tree)[("mlx5_1/1", "nic_port")] == (
        "fail",
        "200 Gb/s, the node's fastest port runs 400",
    )
    got = _run("", tree, expected_nic_rate_gbps=800.0)
    assert got[("mlx5_0/1", "nic_port")] == ("fail", "400 Gb/s, expected 800")


def test_a_hung_gpu_fails_its_check_without_hanging_the_preflight(tree: SysfsTree) -> None:
    got = _run("kind=hang,gpu=1", tree, timeout_s=0.1)
    status, reason = got[("gpu1", "nvml_sanity")]
    assert status == "fail" and "did not answer" in reason
    assert got[("gpu0", "nvml_sanity")][0] == "pass"


def test_a_node_with_broken_nvml_fails_and_the_summary_lists_failures(tree: SysfsTree) -> None:
    backend = GpuBackend(api=NoGpus(), kind="nvml", error="NVML failed (Driver Not Loaded)")
    sampler = GpuSampler(backend.api)
    sampler.open()
    checks = run_preflight_with_load(backend, sampler, NicMonitor(tree.root), load_s=0)
    assert (checks[0].target, checks[0].name, checks[0].status) == ("node", "nvml", "fail")
    assert summary(checks) == (
        "preflight failed 1/3 checks: node nvml: NVML failed (Driver Not Loaded)"
    )
    bare = open_backend("auto", dev_dir=tree.root / "no-dev")
    assert bare.kind == "nvml" and not bare.error


def test_the_controller_asks_through_the_command_channel(
    tree: SysfsTree, tmp_path: Path, agents_controller: FakeController
) -> None:
    agents_controller.queue_command(
        "pf-node", {"id": "pf-1", "kind": "run_preflight", "expected_nic_rate_gbps": 400}
    )
    s = load_settings(
        controller_url=agents_controller.url, token=TOKEN, node_name="pf-node", gpus="sim:2",
        sim_faults=["kind=remap,gpu=1,pending=1"], sample_interval_s=0.05, preflight_load_s=0.5,
        report_interval_s=0.3, spool_dir=tmp_path / "spool", socket_path="", metrics_port=-1,
        powercap_dir=tmp_path / "no-powercap", sysfs_root=tree.root, dev_dir=tmp_path / "no-dev",
    )  # fmt: skip

    def acks() -> list[Any]:
        return [a for r in agents_controller.state.ordered() for a in r.command_acks]

    with Running(Agent(s)):
        agents_controller.wait_for(lambda: len(acks()) == 1, timeout_s=60)
    (ack,) = acks()
    assert ack.command_id == "pf-1" and ack.status == "failed"
    assert ack.reason == (
        "preflight failed 1/15 checks: gpu1 memory_repair: row remap pending: reset the GPU first"
    )
