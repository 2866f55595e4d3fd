"""NIC evidence for slow communication (issue 17): plain data in, suspects ranked out."""

from __future__ import annotations

from controller.logic.detection.nic_evidence import (
    InvolvedRank,
    NicIssue,
    NicPort,
    affine_nics,
    device_order,
    nic_evidence,
)

#: A two-rail node: mlx5_0 shares a PCIe switch with GPU 0, mlx5_1 with GPU 1.
RAILS = [
    NicPort(device="mlx5_1", port=1, pci_bus_id="0000:9a:00.0", gpu_affinity={0: "SYS", 1: "PIX"}),
    NicPort(device="mlx5_0", port=1, pci_bus_id="0000:1a:00.0", gpu_affinity={0: "PIX", 1: "SYS"}),
]
NOW = 10_000.0


def issue(node: str, device: str, signal: str, count: int = 1, age_s: float = 10.0) -> NicIssue:
    return NicIssue(node=node, device=device, signal=signal, count=count, last_unix_s=NOW - age_s)


def test_devices_are_numbered_in_pci_order_and_each_gpu_gets_its_nearest_nic() -> None:
    assert device_order(RAILS) == ["mlx5_0", "mlx5_1"]
    got = affine_nics(
        {"a": RAILS},
        [InvolvedRank(rank=3, node="a", gpu_index=1), InvolvedRank(rank=9, node="b", gpu_index=0)],
    )
    assert [(x.rank, x.device, x.level, x.nic_index) for x in got] == [(3, "mlx5_1", "PIX", 1)]


def test_the_involved_gpus_nearest_nic_with_errors_is_the_first_suspect() -> None:
    involved = [
        InvolvedRank(rank=3, node="a", gpu_index=1),
        InvolvedRank(rank=4, node="b", gpu_index=0),
    ]
    ev = nic_evidence(
        [
            issue("a", "mlx5_0", "nic_port_down", count=5),  # worse signal, but not rank 3's NIC
            issue("a", "mlx5_1", "nic_errors_rising", count=2),  # rank 3's NIC
            issue("b", "mlx5_1", "nic_gone"),  # node b has no inventory: no affinity known
            issue("c", "mlx5_0", "nic_gone"),  # node c is not involved
            issue("a", "mlx5_1", "nvlink_down"),  # not a NIC signal
            issue("b", "mlx5_2", "nic_errors_rising", age_s=5_000.0),  # too old
        ],
        {"a": RAILS},
        involved,
        NOW,
    )
    assert [(s.node, s.device, s.signal) for s in ev.suspects] == [
        ("a", "mlx5_1", "nic_errors_rising"),
        ("b", "mlx5_1", "nic_gone"),
        ("a", "mlx5_0", "nic_port_down"),
    ]
    first = ev.suspects[0]
    assert (first.affine_ranks, first.nic_index, first.count, first.age_s) == ([3], 1, 2, 10.0)
    assert ev.suspects[1].nic_index is None and ev.suspects[2].nic_index == 0
    assert ev.headline() == (
        "first suspect: NIC mlx5_1 on a (nic_errors_rising x2, nearest NIC of rank(s) [3])"
        " (+2 more)"
    )
    # Typed evidence round-trips through JSON as the incident stores it.
    assert ev.as_json()["suspects"][0]["device"] == "mlx5_1"  # type: ignore[index]


def test_the_worst_signal_of_a_nic_stands_for_it_and_no_issue_means_no_suspect() -> None:
    involved = [InvolvedRank(rank=0, node="a", gpu_index=0)]
    ev = nic_evidence(
        [issue("a", "mlx5_0", "nic_errors_rising", 7), issue("a", "mlx5_0", "nic_port_down", 1)],
        {"a": RAILS},
        involved,
        NOW,
    )
    assert [(s.signal, s.affine_ranks) for s in ev.suspects] == [("nic_port_down", [0])]
    empty = nic_evidence([], {"a": RAILS}, involved, NOW)
    assert empty.suspects == [] and empty.headline() == ""
    assert [a.device for a in empty.affine] == ["mlx5_0"]
