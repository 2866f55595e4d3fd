"""Fabric links of NICs that show errors or flaps: how much capacity the planner gives them.

A NIC named as a suspect (``controller.logic.detection.nic_evidence``) degrades every link
between its ports and their leaf switch, both directions, so the planner moves flows off it
in proportion: a NIC gone is nearly avoided, a flapping port is mostly avoided, a NIC whose
error counters rise keeps half its capacity. The factors are policy, not measurements.
"""

from __future__ import annotations

from collections.abc import Iterable

from controller.logic.traffic.topology import Topology

#: Capacity factor per NIC signal (0 would be "down", which only an operator decides).
NIC_SIGNAL_FACTOR: dict[str, float] = {
    "nic_gone": 0.05,
    "nic_port_down": 0.25,
    "bond_member_down": 0.5,
    "nic_errors_rising": 0.5,
}


def nic_links(topo: Topology, node: str, nic_index: int) -> list[str]:
    """Names of the links (up and down) of every port of ``node``'s NIC ``nic_index``;
    empty when the fabric does not know that node or NIC."""
    i = topo.node_index.get(node)
    if i is None or not 0 <= nic_index < len(topo.ports[i]):
        return []
    out: list[str] = []
    for ref in topo.ports[i][nic_index]:
        out += [topo.link_names[ref.up_link], topo.link_names[ref.down_link]]
    return out


def nic_link_factors(
    topo: Topology, suspects: Iterable[tuple[str, int, str]]
) -> list[tuple[str, float]]:
    """(link, capacity factor) for suspects given as (node, nic index, signal); a link named
    twice keeps the lower factor. Unknown signals and NICs outside the fabric are skipped."""
    factors: dict[str, float] = {}
    for node, nic_index, signal in suspects:
        factor = NIC_SIGNAL_FACTOR.get(signal)
        if factor is None:
            continue
        for link in nic_links(topo, node, nic_index):
            factors[link] = min(factor, factors.get(link, 1.0))
    return sorted(factors.items())


def merge_link_factors(*changes: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    """One change per link, the lowest factor wins (probe evidence and NIC evidence)."""
    out: dict[str, float] = {}
    for group in changes:
        for link, factor in group:
            out[link] = min(factor, out.get(link, 1.0))
    return sorted(out.items())


__all__ = ["NIC_SIGNAL_FACTOR", "merge_link_factors", "nic_link_factors", "nic_links"]
