"""RDMA ports, bonds and GPU-to-NIC affinity from a sysfs tree laid out as the kernel does."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agents.daemon import Agent
from agents.nics import NicMonitor, affinity_level, parse_rate_gbps, sysfs_bdf
from agents.settings import load_settings
from tests.agents.agents_testkit import TOKEN, FakeController
from tests.agents.sysfs_tree import SysfsTree

SIM_BUS_IDS = {i: f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(4)}


@pytest.fixture
def tree(tmp_path: Path) -> SysfsTree:
    return SysfsTree(tmp_path / "sys").build()


def test_parsers() -> None:
    assert parse_rate_gbps("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate_gbps("25 Gb/sec (1X EDR)") == 25.0
    assert parse_rate_gbps("garbage") is None and parse_rate_gbps(None) is None
    assert sysfs_bdf("00000000:18:00.0") == "0000:18:00.0"
    assert sysfs_bdf("0000:AB:00.1") == "0000:ab:00.1"


def test_inventory_names_each_port_and_its_pcie_distance_to_every_gpu(tree: SysfsTree) -> None:
    nics = NicMonitor(tree.root).inventory(SIM_BUS_IDS)
    assert [(n.device, n.port) for n in nics] == [("mlx5_0", 1), ("mlx5_1", 1)]
    first, second = nics
    assert first.pci_bus_id == "0000:19:00.0" and first.netdev == "ibp25s0"
    assert first.link_layer == "InfiniBand" and first.numa_node == 0
    # GPU 0 behind the same PCIe switch; GPU 1 on another root port of the same host
    # bridge; GPU 2 on another host bridge of the same NUMA node; GPU 3 on the other socket.
    assert first.gpu_affinity == {0: "PIX", 1: "PHB", 2: "NODE", 3: "SYS"}
    assert second.gpu_affinity == {0: "SYS", 1: "SYS", 2: "SYS", 3: "PIX"}


def test_affinity_through_two_switch_levels_is_pxb() -> None:
    gpu = ("pci0000:00", ["0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0",
                          "0000:04:00.0", "0000:05:00.0"])  # fmt: skip
    nic = ("pci0000:00", ["0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:06:00.0"])
    assert affinity_level(gpu, nic, 0, 0) == "PXB"
    assert affinity_level(None, nic, 0, 0) == "SYS"


def test_ports_are_read_with_state_rate_and_a_bounded_counter_set(tree: SysfsTree) -> None:
    tree.set_counter("mlx5_0", 1, "symbol_error", 7)
    tree.set_counter("mlx5_0", 1, "np_cnp_sent", 1234, hw=True)
    ports, events = NicMonitor(tree.root).sample(1000.0)
    assert events == []
    port = ports[0]
    assert (port.device, port.port, port.state, port.phys_state) == (
        "mlx5_0", 1, "ACTIVE", "LinkUp",
    )  # fmt: skip
    assert port.rate_gbps == 400.0
    assert port.counters["symbol_error"] == 7 and port.counters["np_cnp_sent"] == 1234
    # Files outside the documented set (VL15_dropped, lifespan) are not shipped.
    assert "VL15_dropped" not in port.counters and "lifespan" not in port.counters


def test_flaps_error_rises_and_a_nic_that_disappears_mid_run(tree: SysfsTree) -> None:
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    mon.sample(0.0)
    tree.set_port("mlx5_0", 1, state="1: DOWN", phys_state="3: Disabled")
    _, events = mon.sample(1.0)
    assert [(e.kind, e.device, e.port) for e in events] == [("nic_port_down", "mlx5_0", 1)]
    assert events[0].detail == "mlx5_0 port 1 DOWN (Disabled)"
    tree.set_port("mlx5_0", 1, state="4: ACTIVE", phys_state="5: LinkUp")
    assert [e.kind for e in mon.sample(2.0)[1]] == ["nic_port_up"]
    # A flap between two reads is only visible in link_downed.
    tree.set_counter("mlx5_0", 1, "link_downed", 2)
    (flap,) = mon.sample(3.0)[1]
    assert (flap.kind, flap.counter, flap.delta) == ("nic_port_down", "link_downed", 2)
    # Symbol errors: 6 then 6 more within the minute crosses 10 once, not on every tick.
    tree.set_counter("mlx5_1", 1, "symbol_error", 6)
    assert mon.sample(4.0)[1] == []
    tree.set_counter("mlx5_1", 1, "symbol_error", 12)
    (rise,) = mon.sample(5.0)[1]
    assert (rise.kind, rise.device, rise.counter, rise.delta) == (
        "nic_errors_rising", "mlx5_1", "symbol_error", 12,
    )  # fmt: skip
    tree.set_counter("mlx5_1", 1, "symbol_error", 13)
    assert mon.sample(6.0)[1] == []
    # After a quiet minute, a new burst is a new episode.
    assert mon.sample(70.0)[1] == []
    tree.set_counter("mlx5_1", 1, "symbol_error", 30)
    assert [e.kind for e in mon.sample(71.0)[1]] == ["nic_errors_rising"]
    # The card falls off the bus mid-run: one event, no crash, its port is no longer read.
    tree.remove_nic("mlx5_1")
    ports, events = mon.sample(72.0)
    assert [(e.kind, e.device) for e in events] == [("nic_gone", "mlx5_1")]
    assert [p.device for p in ports] == ["mlx5_0"]
    assert mon.sample(73.0)[1] == []
    assert [i.device for i in mon.inventory(SIM_BUS_IDS)] == ["mlx5_0"]
    tree.add_nic("mlx5_1")
    assert [(e.kind, e.device) for e in mon.sample(74.0)[1]] == [("nic_back", "mlx5_1")]


def test_a_port_whose_files_vanish_between_listing_and_reading_is_skipped(tree: SysfsTree) -> None:
    mon = NicMonitor(tree.root)
    (tree.port_dir("mlx5_0", 1) / "state").unlink()
    ports, _ = mon.sample(0.0)
    assert [p.device for p in ports] == ["mlx5_1"]


def test_one_bad_counter_file_costs_that_counter_not_the_port(
    tree: SysfsTree, caplog: pytest.LogCaptureFixture
) -> None:
    """A u64 counter past 2^63-1 (near its wrap, or 2^64-1 for "not available") and a file
    of non-UTF-8 bytes each lose their own field, with one warning line per file."""
    mon = NicMonitor(tree.root)
    tree.set_counter("mlx5_0", 1, "port_xmit_data", 18446744073709551611)
    (tree.port_dir("mlx5_1", 1) / "counters" / "port_rcv_errors").write_bytes(b"\xff\xfe\n")
    with caplog.at_level("WARNING", logger="agents.nics"):
        ports, events = mon.sample(0.0)
        mon.sample(1.0)
    assert events == [] and [p.device for p in ports] == ["mlx5_0", "mlx5_1"]
    assert "port_xmit_data" not in ports[0].counters and ports[0].counters["symbol_error"] == 0
    assert "port_rcv_errors" not in ports[1].counters and ports[1].counters["symbol_error"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert "port_xmit_data: value 18446744073709551611 is past" in lines[0]
    assert "port_rcv_errors: not UTF-8 text" in lines[1]


def test_a_counter_unknown_for_a_tick_is_a_reset_not_a_rise_or_a_flap(tree: SysfsTree) -> None:
    mon = NicMonitor(tree.root, error_threshold=10, window_s=60)
    tree.set_counter("mlx5_0", 1, "symbol_error", 5)
    tree.set_counter("mlx5_0", 1, "link_downed", 3)
    assert mon.sample(0.0)[1] == []
    # Both counters read 2^64-1 ("not available") for a tick, then come back higher.
    tree.set_counter("mlx5_0", 1, "symbol_error", 2**64 - 1)
    tree.set_counter("mlx5_0", 1, "link_downed", 2**64 - 1)
    assert mon.sample(1.0)[1] == []
    tree.set_counter("mlx5_0", 1, "symbol_error", 40)
    tree.set_counter("mlx5_0", 1, "link_downed", 9)
    assert mon.sample(2.0)[1] == []
    # From there on the counters are compared again.
    tree.set_counter("mlx5_0", 1, "symbol_error", 50)
    tree.set_counter("mlx5_0", 1, "link_downed", 10)
    assert [(e.kind, e.counter, e.delta) for e in mon.sample(3.0)[1]] == [
        ("nic_port_down", "link_downed", 1), ("nic_errors_rising", "symbol_error", 10),
    ]  # fmt: skip


def test_a_bond_member_file_of_bytes_or_out_of_range_costs_that_field(tree: SysfsTree) -> None:
    iface = tree.root / "class" / "net" / "eno1"
    (iface / "speed").write_text(str(2**40))
    (iface / "bonding_slave" / "link_failure_count").write_text(str(2**64 - 1))
    (iface / "operstate").write_bytes(b"\xffup\n")
    bonds, _ = NicMonitor(tree.root).bonds(0.0)
    eno1, eno2 = bonds[0].members
    assert (eno1.speed_mbps, eno1.link_failure_count, eno1.operstate) == (None, None, "")
    assert (eno1.mii_status, eno2.speed_mbps) == ("up", 100000)


def test_bond_members_and_their_failures(tree: SysfsTree) -> None:
    mon = NicMonitor(tree.root)
    bonds, events = mon.bonds(0.0)
    assert events == [] and len(bonds) == 1
    bond = bonds[0]
    assert (bond.name, bond.mode) == ("bond0", "802.3ad 4")
    assert [(m.name, m.mii_status, m.speed_mbps) for m in bond.members] == [
        ("eno1", "up", 100000), ("eno2", "up", 100000),
    ]  # fmt: skip
    tree.set_member("eno2", "down", 1)
    bonds, events = mon.bonds(1.0)
    assert [(e.kind, e.device, e.detail) for e in events] == [
        ("bond_member_down", "bond0", "eno2 of bond0 is down")
    ]
    assert bonds[0].members[1].link_failure_count == 1
    tree.set_member("eno2", "up", 1)
    assert [e.kind for e in mon.bonds(2.0)[1]] == ["bond_member_up"]


def test_a_node_without_rdma_or_bonds_reports_nothing(tmp_path: Path) -> None:
    mon = NicMonitor(tmp_path / "empty-sys")
    assert mon.inventory(SIM_BUS_IDS) == [] and mon.sample(0.0) == ([], [])
    assert mon.bonds(0.0) == ([], [])


def test_the_agent_reports_nics_and_a_vanished_nic_at_once(
    tree: SysfsTree, tmp_path: Path, agents_controller: FakeController
) -> None:
    s = load_settings(
        controller_url=agents_controller.url,
        token=TOKEN,
        node_name="ib-node",
        gpus="sim:4",
        sample_interval_s=0.05,
        report_interval_s=30.0,  # only urgent reports arrive during the test
        spool_dir=tmp_path / "spool",
        socket_path="",
        metrics_port=-1,
        powercap_dir=tmp_path / "no-powercap",
        sysfs_root=tree.root,
        dev_dir=tmp_path / "no-dev",
    )
    agent = Agent(s)
    assert agent.identity.nics[0].gpu_affinity == {0: "PIX", 1: "PHB", 2: "NODE", 3: "SYS"}
    # The card goes away once a sample has listed it (a fixed sleep was sometimes shorter
    # than the agent's first sample on a loaded machine: then nothing was "gone").
    sampled = threading.Event()
    add_sample = agent.batch.add_sample

    def add_and_tell(sample: Any) -> None:
        add_sample(sample)
        sampled.set()

    agent.batch.add_sample = add_and_tell  # type: ignore[method-assign]
    stop = threading.Event()
    agent.start()
    thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    thread.start()
    try:
        assert sampled.wait(10), "the agent took no sample in 10 s"
        tree.remove_nic("mlx5_1")
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 1, 10)
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.stop()
    first = agents_controller.state.ordered()[0]
    # The report that says the card is gone no longer lists it in the node's inventory.
    assert [n.device for n in first.node.nics] == ["mlx5_0"]
    events = [e for x in first.samples for e in x.events]
    assert [(e.kind, e.device) for e in events] == [("nic_gone", "mlx5_1")]
    assert (
        first.samples[0].nics[1].device == "mlx5_1"
        and first.samples[-1].nics[-1].device == "mlx5_0"
    )
    assert first.samples[0].bonds[0].name == "bond0"
