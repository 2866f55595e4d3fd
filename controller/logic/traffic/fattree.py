"""Builders for the fabrics GPU clusters are actually cabled as: leaf-spine (two tiers) and
pod-based three-tier fat trees, ToR or rail-optimized, single-port or bonded dual-port NICs.

Rail-optimized means NIC k of every node in a group goes to rail switch k of that group, so
the ring of GPU k across nodes stays on one switch; with bonded dual-port NICs each port goes
to its own plane's switch (dual-ToR), which is what makes bond-port choice matter: a flow
leaving on port 0 and arriving on the peer's port 1 has to climb to a spine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from controller.logic.traffic.errors import TopologyError
from controller.logic.traffic.topology import (
    CableSpec,
    NicSpec,
    NodeSpec,
    PortSpec,
    SwitchSpec,
    Topology,
)


@dataclass(kw_only=True, slots=True)
class FatTreeSpec:
    """Parameters of a generated fat tree; the link count follows from them."""

    nodes: int
    """Number of GPU servers."""
    nics_per_node: int = 8
    """Scale-out NICs per server (one per GPU on H100/H200 systems)."""
    ports_per_nic: int = 1
    """2 gives bonded dual-port NICs whose ports go to two different leaves (dual-ToR)."""
    port_speed_gbps: float = 200.0
    """Speed of one NIC port and of every switch-to-switch cable."""
    nodes_per_leaf: int = 16
    """Servers per leaf group (per rail switch when rail-optimized)."""
    rail_optimized: bool = True
    """NIC k of each node on rail switch k; otherwise all NICs of a node share a ToR."""
    oversubscription: float = 1.0
    """Leaf downlink capacity divided by uplink capacity; 2.0 means 2:1."""
    tiers: int = 2
    """2 for leaf-spine, 3 for leaf-aggregation-core with pods."""
    leaves_per_pod: int = 8
    """Three tiers only: leaves that share one pod's aggregation switches."""
    core_oversubscription: float = 1.0
    """Three tiers only: aggregation downlink capacity divided by its core uplinks."""
    name: str = "fat-tree"


MAX_SWITCHES = 200_000
"""Most switches a generated fat tree may have. The builder materialises every switch, cable
and NIC port as an object, so a spec whose counts follow from a tiny oversubscription or a huge
``nodes_per_leaf`` would otherwise spin (and fill memory) for ever instead of failing."""
MAX_LINKS = 4_000_000
"""Most cables plus NIC ports a generated fat tree may have (about 40 s to build at the
limit); 131,072 eight-NIC servers at the defaults need 2.1 million."""


def _positive(spec: FatTreeSpec) -> None:
    for key in ("nodes", "nics_per_node", "ports_per_nic", "nodes_per_leaf", "leaves_per_pod"):
        if int(getattr(spec, key)) < 1:
            raise TopologyError(f"fat_tree.{key} must be >= 1")
    for key in ("port_speed_gbps", "oversubscription", "core_oversubscription"):
        value = float(getattr(spec, key))
        if not (math.isfinite(value) and value > 0):
            raise TopologyError(f"fat_tree.{key} must be a finite number > 0")
    if spec.tiers not in (2, 3):
        raise TopologyError("fat_tree.tiers must be 2 or 3")
    if spec.ports_per_nic > 4:
        raise TopologyError("fat_tree.ports_per_nic must be 1..4")


def _uplinks(down: int, ratio: float, key: str, down_key: str) -> int:
    """``max(1, round(down / ratio))``, refused before it can become an absurd switch count
    (or ``inf``, which ``round`` cannot take) and name the field to change."""
    up = down / ratio
    if not up <= MAX_SWITCHES:
        field = key if ratio < 1 else down_key
        raise TopologyError(
            f"fat_tree.{field}: gives {up:.3g} uplinks per switch "
            f"({down_key} / {key}); a generated fat tree may have at most {MAX_SWITCHES} switches"
        )
    return max(1, round(up))


def _check_size(spec: FatTreeSpec, n_leaves: int, n_up: int, n_core: int) -> None:
    """Count what the builder would create, in plain integers, before creating any of it."""
    ports = spec.nodes * spec.nics_per_node * spec.ports_per_nic
    if spec.tiers == 2:
        switches = n_leaves + n_up
        cables = n_leaves * n_up
    else:
        pods = math.ceil(n_leaves / spec.leaves_per_pod)
        switches = n_leaves + n_up * n_core + pods * n_up
        cables = n_leaves * n_up + pods * n_up * n_core
    if switches > MAX_SWITCHES:
        raise TopologyError(
            f"fat_tree: {switches} switches (nodes, nodes_per_leaf, oversubscription"
            f"{', leaves_per_pod' if spec.tiers == 3 else ''}); the limit is {MAX_SWITCHES}"
        )
    if cables + ports > MAX_LINKS:
        raise TopologyError(
            f"fat_tree: {cables} cables + {ports} NIC ports (nodes, nics_per_node, "
            f"ports_per_nic, oversubscription); the limit is {MAX_LINKS} links"
        )


def build_fat_tree(spec: FatTreeSpec) -> Topology:
    _positive(spec)
    speed = spec.port_speed_gbps
    groups = math.ceil(spec.nodes / spec.nodes_per_leaf)
    rails = spec.nics_per_node if spec.rail_optimized else 1
    planes = spec.ports_per_nic
    down_ports = spec.nodes_per_leaf * (1 if spec.rail_optimized else spec.nics_per_node)
    n_up = _uplinks(down_ports, spec.oversubscription, "oversubscription", "nodes_per_leaf")
    n_core = 1
    if spec.tiers == 3:
        n_core = _uplinks(
            spec.leaves_per_pod,
            spec.core_oversubscription,
            "core_oversubscription",
            "leaves_per_pod",
        )
    _check_size(spec, groups * rails * planes, n_up, n_core)

    def leaf_name(g: int, r: int, p: int) -> str:
        return f"leaf-g{g:03d}-r{r}-p{p}" if spec.rail_optimized else f"leaf-g{g:03d}-p{p}"

    leaves = [
        leaf_name(g, r, p) for g in range(groups) for r in range(rails) for p in range(planes)
    ]
    switches = [SwitchSpec(name=leaf, tier=1) for leaf in leaves]
    cables: list[CableSpec] = []
    if spec.tiers == 2:
        spines = [f"spine-{j:03d}" for j in range(n_up)]
        switches += [SwitchSpec(name=s, tier=2) for s in spines]
        cables += [CableSpec(leaf, s, speed) for leaf in leaves for s in spines]
    else:
        pods = math.ceil(len(leaves) / spec.leaves_per_pod)
        cores = [[f"core-{j:03d}-{c:03d}" for c in range(n_core)] for j in range(n_up)]
        switches += [SwitchSpec(name=c, tier=3) for grp in cores for c in grp]
        for pod in range(pods):
            aggs = [f"agg-p{pod:03d}-{j:03d}" for j in range(n_up)]
            switches += [SwitchSpec(name=a, tier=2) for a in aggs]
            for leaf in leaves[pod * spec.leaves_per_pod : (pod + 1) * spec.leaves_per_pod]:
                cables += [CableSpec(leaf, a, speed) for a in aggs]
            for j, a in enumerate(aggs):
                cables += [CableSpec(a, c, speed) for c in cores[j]]
    nodes = []
    for i in range(spec.nodes):
        g = i // spec.nodes_per_leaf
        nics = tuple(
            NicSpec(
                ports=tuple(
                    PortSpec(
                        leaf=leaf_name(g, k if spec.rail_optimized else 0, p), capacity_gbps=speed
                    )
                    for p in range(planes)
                )
            )
            for k in range(spec.nics_per_node)
        )
        nodes.append(NodeSpec(name=f"node-{i:05d}", nics=nics))
    return Topology(
        name=spec.name,
        switches=tuple(switches),
        cables=tuple(cables),
        nodes=tuple(nodes),
        meta={"fat_tree": asdict(spec)},
    )


__all__ = ["MAX_LINKS", "MAX_SWITCHES", "FatTreeSpec", "build_fat_tree"]
