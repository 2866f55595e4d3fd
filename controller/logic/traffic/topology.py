"""The network model: switches in tiers, cables between them, and nodes whose NIC ports hang
off leaf switches.

Everything the planner and the simulator touch per flow is an integer link index into flat
numpy arrays (capacity, health factor), because a 4,096-GPU job has tens of thousands of flows
and per-object Python lookups would dominate planning time. Names stay available for output:
a link is called ``"<from>-><to>"`` and a NIC port is the device ``"<node>/nic<k>/p<p>"``.

Links are directed (a cable is two links) since collective rings load the two directions
differently. A link's health factor scales its capacity: 1 healthy, 0 down, in between slow
(from a slow-link incident); routes never use a link whose factor is 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import TopologyError

FloatArray = npt.NDArray[np.float64]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_TIER = 3
MAX_PORTS_PER_NIC = 4
GBPS_TO_BYTES_PER_S = 1e9 / 8
MIN_SLOW_FACTOR = 1e-9
"""Smallest health factor of a slow link. Any capacity times this stays far above the
range where ``bytes / capacity`` overflows (capacities are >= 0.001 Gb/s), so an almost
dead link keeps a finite, huge time; below it a link must be marked down."""


@dataclass(frozen=True, slots=True)
class SwitchSpec:
    """A switch; tier 1 is a leaf (ToR or rail switch), 2 a spine/aggregation, 3 a core."""

    name: str
    tier: int


@dataclass(frozen=True, slots=True)
class CableSpec:
    """A full-duplex cable from a tier-t switch (``lower``) up to a tier-t+1 one (``upper``)."""

    lower: str
    upper: str
    capacity_gbps: float


@dataclass(frozen=True, slots=True)
class PortSpec:
    """One physical port of a NIC and the leaf it is cabled to."""

    leaf: str
    capacity_gbps: float


@dataclass(frozen=True, slots=True)
class NicSpec:
    """A NIC; two or more ports form a bond that shares one IP address."""

    ports: tuple[PortSpec, ...]
    ip: int | None = None


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    nics: tuple[NicSpec, ...]


@dataclass(frozen=True, slots=True)
class PortRef:
    """Where one NIC port sits in the link arrays."""

    node: int
    nic: int
    port: int
    leaf: str
    up_link: int
    down_link: int


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TopologyError(
            f"{kind} name {name!r} is invalid: use 1-128 letters, digits, '.', '_', ':' or '-'"
        )


def default_ip(node: int, nic: int) -> int:
    """10.<node hi>.<node lo>.<nic>, unique for up to 65,536 nodes of 256 NICs."""
    return (10 << 24) | ((node & 0xFFFF) << 8) | (nic & 0xFF)


@dataclass(slots=True, eq=False)
class Topology:
    """A validated fabric. Build it with :func:`controller.logic.traffic.fattree.build_fat_tree`
    or :func:`controller.logic.traffic.topofile.load_topology`; the constructor checks
    everything."""

    name: str
    switches: tuple[SwitchSpec, ...]
    cables: tuple[CableSpec, ...]
    nodes: tuple[NodeSpec, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    tier: dict[str, int] = field(init=False)
    link_names: list[str] = field(init=False)
    link_src: list[str] = field(init=False)
    link_dst: list[str] = field(init=False)
    base_capacity_bytes_per_s: FloatArray = field(init=False)
    health: FloatArray = field(init=False)
    link_index: dict[str, int] = field(init=False)
    up: dict[str, list[tuple[str, int]]] = field(init=False)
    down: dict[str, list[tuple[str, int]]] = field(init=False)
    node_index: dict[str, int] = field(init=False)
    ports: list[list[list[PortRef]]] = field(init=False)
    nic_ips: list[list[int]] = field(init=False)
    leaves: list[str] = field(init=False)
    leaf_bit: dict[str, int] = field(init=False)
    epoch: int = field(init=False, default=0)
    _desc: dict[str, int] | None = field(init=False, default=None)
    _pods: dict[str, int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise TopologyError("topology has no nodes")
        self.tier = {}
        for sw in self.switches:
            _check_name("switch", sw.name)
            if sw.name in self.tier:
                raise TopologyError(f"switch {sw.name!r} is defined twice")
            if not 1 <= sw.tier <= MAX_TIER:
                raise TopologyError(f"switch {sw.name!r}: tier must be 1..{MAX_TIER}")
            self.tier[sw.name] = sw.tier
        self.link_names, self.link_src, self.link_dst = [], [], []
        caps: list[float] = []
        self.up = {s.name: [] for s in self.switches}
        self.down = {s.name: [] for s in self.switches}

        def add(src: str, dst: str, cap_gbps: float) -> int:
            self.link_names.append(f"{src}->{dst}")
            self.link_src.append(src)
            self.link_dst.append(dst)
            caps.append(cap_gbps * GBPS_TO_BYTES_PER_S)
            return len(caps) - 1

        seen: set[tuple[str, str]] = set()
        for c in self.cables:
            for end in (c.lower, c.upper):
                if end not in self.tier:
                    raise TopologyError(f"cable {c.lower}--{c.upper}: unknown switch {end!r}")
            if self.tier[c.upper] != self.tier[c.lower] + 1:
                raise TopologyError(
                    f"cable {c.lower}--{c.upper}: must join tier t to tier t+1 "
                    f"(got {self.tier[c.lower]} and {self.tier[c.upper]})"
                )
            if not c.capacity_gbps > 0:
                raise TopologyError(f"cable {c.lower}--{c.upper}: capacity_gbps must be > 0")
            if (c.lower, c.upper) in seen:
                raise TopologyError(f"cable {c.lower}--{c.upper} is defined twice")
            seen.add((c.lower, c.upper))
            self.up[c.lower].append((c.upper, add(c.lower, c.upper, c.capacity_gbps)))
            self.down[c.upper].append((c.lower, add(c.upper, c.lower, c.capacity_gbps)))
        self.node_index = {}
        self.ports = []
        self.nic_ips = []
        ips: set[int] = set()
        for i, node in enumerate(self.nodes):
            _check_name("node", node.name)
            if node.name in self.node_index or node.name in self.tier:
                raise TopologyError(f"node {node.name!r} is defined twice")
            self.node_index[node.name] = i
            if not node.nics:
                raise TopologyError(f"node {node.name!r} has no NICs")
            nic_refs: list[list[PortRef]] = []
            nic_ips: list[int] = []
            for k, nic in enumerate(node.nics):
                if not 1 <= len(nic.ports) <= MAX_PORTS_PER_NIC:
                    raise TopologyError(
                        f"node {node.name!r} nic{k}: needs 1..{MAX_PORTS_PER_NIC} ports"
                    )
                refs: list[PortRef] = []
                for p, port in enumerate(nic.ports):
                    where = f"node {node.name!r} nic{k} port {p}"
                    if self.tier.get(port.leaf) != 1:
                        raise TopologyError(f"{where}: leaf {port.leaf!r} is not a tier-1 switch")
                    if not port.capacity_gbps > 0:
                        raise TopologyError(f"{where}: capacity_gbps must be > 0")
                    dev = f"{node.name}/nic{k}/p{p}"
                    ul = add(dev, port.leaf, port.capacity_gbps)
                    dl = add(port.leaf, dev, port.capacity_gbps)
                    refs.append(PortRef(i, k, p, port.leaf, ul, dl))
                ip = default_ip(i, k) if nic.ip is None else nic.ip
                if ip in ips:
                    raise TopologyError(f"node {node.name!r} nic{k}: IP address used twice")
                ips.add(ip)
                nic_ips.append(ip)
                nic_refs.append(refs)
            self.ports.append(nic_refs)
            self.nic_ips.append(nic_ips)
        for lst in (*self.up.values(), *self.down.values()):
            lst.sort(key=lambda e: self.link_names[e[1]])
        self.base_capacity_bytes_per_s = np.asarray(caps, dtype=np.float64)
        self.health = np.ones(len(caps), dtype=np.float64)
        self.link_index = {n: i for i, n in enumerate(self.link_names)}
        self.leaves = sorted(s.name for s in self.switches if s.tier == 1)
        self.leaf_bit = {leaf: 1 << i for i, leaf in enumerate(self.leaves)}
        self._check_connected()

    def _check_connected(self) -> None:
        g: nx.Graph = nx.Graph()
        used = {ref.leaf for nic in self.ports for refs in nic for ref in refs}
        g.add_nodes_from(used)
        g.add_edges_from((c.lower, c.upper) for c in self.cables)
        comp = nx.node_connected_component(g, next(iter(sorted(used))))
        missing = sorted(used - comp)
        if missing:
            raise TopologyError(f"leaf {missing[0]!r} has no path to the rest of the fabric")

    # ------------------------------------------------------------------ capacity and health

    @property
    def n_links(self) -> int:
        return len(self.link_names)

    @property
    def dummy_link(self) -> int:
        """Index used to pad paths of different lengths; infinite capacity, never loaded."""
        return len(self.link_names)

    def capacity_ext(self) -> FloatArray:
        """Effective capacities (bytes/s) with the dummy padding link appended as +inf."""
        return np.append(self.base_capacity_bytes_per_s * self.health, np.inf)

    def alive(self, link: int) -> bool:
        return bool(self.health[link] > 0.0)

    def resolve_link(self, spec: str) -> list[int]:
        """Link indices named by ``a->b`` (one direction) or ``a--b`` / ``a<->b`` (both)."""
        if spec in self.link_index:
            return [self.link_index[spec]]
        for sep in ("<->", "--"):
            # Names may contain "--" themselves (switch "l--1"): try every split point and
            # keep those naming a cable between two endpoints.
            matches: dict[tuple[str, str], list[int]] = {}
            at = spec.find(sep)
            while at > 0:
                a, b = spec[:at], spec[at + len(sep) :]
                found = [
                    self.link_index[n] for n in (f"{a}->{b}", f"{b}->{a}") if n in self.link_index
                ]
                if found:
                    matches[(a, b)] = found
                at = spec.find(sep, at + 1)
            if len(matches) > 1:
                pairs = ", ".join(f"{a!r} and {b!r}" for a, b in matches)
                raise TopologyError(
                    f"ambiguous link {spec!r}: it names the cables between {pairs}; "
                    "use 'a->b' for one direction"
                )
            if matches:
                return next(iter(matches.values()))
        raise TopologyError(f"unknown link {spec!r}: use 'a->b' for one direction or 'a--b'")

    def set_health(self, links: list[int], factor: float) -> None:
        """Mark links down (0), slow (MIN_SLOW_FACTOR <= f < 1) or healthy (1); routes are
        recomputed. A positive factor below MIN_SLOW_FACTOR (a denormal such as 5e-324) is
        refused naming the link: it is down in all but name, and ``load / capacity`` over it
        overflows to inf, so the planner would fail with "no candidate path with capacity
        left" naming a flow index instead of the link."""
        if not 0.0 <= factor <= 1.0:
            raise TopologyError(f"link health factor must be within 0..1, got {factor}")
        if 0.0 < factor < MIN_SLOW_FACTOR:
            first = self.link_names[links[0]] if len(links) else "?"
            raise TopologyError(
                f"link {first}: health factor {factor!r} is below {MIN_SLOW_FACTOR!r}; "
                "mark the link down (0) instead"
            )
        self.health[links] = factor
        self.epoch += 1
        self._desc = None

    # ------------------------------------------------------------------ structure for routing

    def descendants(self) -> dict[str, int]:
        """Bitmask of leaves reachable downward over live links from each switch."""
        if self._desc is None:
            desc: dict[str, int] = {leaf: self.leaf_bit[leaf] for leaf in self.leaves}
            for t in range(2, MAX_TIER + 1):
                for sw, kids in self.down.items():
                    if self.tier[sw] != t:
                        continue
                    m = 0
                    for kid, link in kids:
                        if self.health[link] > 0.0:
                            m |= desc.get(kid, 0)
                    desc[sw] = m
            self._desc = desc
        return self._desc

    def nic_leaves(self, node: int, nic: int) -> tuple[str, ...]:
        return tuple(ref.leaf for ref in self.ports[node][nic])

    def nic_capacity_bytes_per_s(self, node: int, nic: int, *, egress: bool) -> float:
        cap = self.capacity_ext()
        return float(
            sum(cap[ref.up_link if egress else ref.down_link] for ref in self.ports[node][nic])
        )

    def pods(self) -> dict[str, int]:
        """Leaf → pod number, pods being the islands left when the core tier is removed."""
        if self._pods is not None:
            return self._pods
        g: nx.Graph = nx.Graph()
        g.add_nodes_from(self.leaves)
        g.add_edges_from((c.lower, c.upper) for c in self.cables if self.tier[c.upper] < MAX_TIER)
        out: dict[str, int] = {}
        for i, comp in enumerate(sorted(nx.connected_components(g), key=min)):
            for sw in comp:
                if sw in self.leaf_bit:
                    out[sw] = i
        self._pods = out
        return out

    @property
    def max_tier(self) -> int:
        return max(self.tier.values(), default=1)

    def graph(self) -> nx.DiGraph:
        """The whole fabric as a directed graph for inspection and independent checks.

        Vertices are switches, NICs (``node/nic<k>``) and NIC ports; every edge that is a
        link carries ``link`` (its index) and ``capacity_bytes_per_s``.
        """
        g: nx.DiGraph = nx.DiGraph()
        cap = self.capacity_ext()
        for i, name in enumerate(self.link_names):
            g.add_edge(
                self.link_src[i], self.link_dst[i], link=i, capacity_bytes_per_s=cap[i], name=name
            )
        for node in self.ports:
            for refs in node:
                for ref in refs:
                    nic = f"{self.nodes[ref.node].name}/nic{ref.nic}"
                    port = f"{nic}/p{ref.port}"
                    g.add_edge(nic, port, link=None)
                    g.add_edge(port, nic, link=None)
        return g

    def summary(self) -> dict[str, Any]:
        tiers: dict[int, int] = {}
        for t in self.tier.values():
            tiers[t] = tiers.get(t, 0) + 1
        return {
            "name": self.name,
            "nodes": len(self.nodes),
            "nics": sum(len(n.nics) for n in self.nodes),
            "switches_by_tier": {str(k): v for k, v in sorted(tiers.items())},
            "links": self.n_links,
            "links_down": int((self.health == 0).sum()),
            "links_slow": int(((self.health > 0) & (self.health < 1)).sum()),
            **self.meta,
        }


__all__ = [
    "MIN_SLOW_FACTOR",
    "CableSpec",
    "NicSpec",
    "NodeSpec",
    "PortRef",
    "PortSpec",
    "SwitchSpec",
    "Topology",
    "default_ip",
]
