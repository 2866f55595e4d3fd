"""Loading a topology from a YAML/JSON file or from Kubernetes node labels.

A file either describes a generated fat tree (``fat_tree:`` with the fields of
:class:`~.fattree.FatTreeSpec`) or lists the fabric explicitly (``switches``, ``cables``,
``nodes``). Validation is strict: unknown keys, wrong types and dangling names are refused
with one line naming the field, e.g. ``nodes.3.nics.0.ports.1.leaf: unknown switch``.

Labels carry only what a node knows about itself: which leaf each NIC port is cabled to
(``topology.trainguard.io/nic<k>: leafA[,leafB]``, several leaves for a bonded NIC) and
optionally ``topology.trainguard.io/port-speed-gbps``. The leaf-spine layer above them
comes from :class:`LabelFabric` (spine count and oversubscription), since no node can know it.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.logic.traffic.errors import TopologyError
from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
from controller.logic.traffic.topology import (
    CableSpec,
    NicSpec,
    NodeSpec,
    PortSpec,
    SwitchSpec,
    Topology,
)
from trainguard.textfile import Unparsable, Unreadable, load_document, read_text

LABEL_PREFIX = "topology.trainguard.io/"
_NIC_LABEL = re.compile(r"^nic(\d{1,3})$")


MAX_GBPS = 1_000_000.0
"""Largest port or cable speed accepted (1 Pb/s; real ports are at most a few Tb/s). Bounded
and finite so ``inf`` (``1e309`` in JSON) or ``1e300`` cannot reach the planner's arithmetic,
where a link of infinite capacity makes every load ratio 0 or NaN."""


MIN_GBPS = 0.001
"""Smallest port or cable speed accepted (1 Mb/s). A positive but denormal speed (``5e-324``)
passed ``> 0`` and then overflowed ``load / capacity`` to ``inf`` in the planner, which
refused the job with a misleading "no candidate path with capacity left"; so a speed that
is zero in all but name is refused at load, naming the field, like 0 is."""


MAX_LABEL_SPINES = 4096
"""Most spines a label fabric may name: every leaf gets a cable to each, built as objects."""


def _gbps(default: float | None) -> Any:
    return Field(default, ge=MIN_GBPS, le=MAX_GBPS, allow_inf_nan=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FatTreeIn(_Strict):
    nodes: int = Field(ge=1, le=1_000_000)
    nics_per_node: int = Field(8, ge=1, le=64)
    ports_per_nic: int = Field(1, ge=1, le=4)
    port_speed_gbps: float = _gbps(200.0)
    nodes_per_leaf: int = Field(16, ge=1)
    rail_optimized: bool = True
    oversubscription: float = Field(1.0, gt=0, allow_inf_nan=False)
    tiers: Literal[2, 3] = 2
    leaves_per_pod: int = Field(8, ge=1)
    core_oversubscription: float = Field(1.0, gt=0, allow_inf_nan=False)


class SwitchIn(_Strict):
    name: str
    tier: int = Field(ge=1, le=3)


class CableIn(_Strict):
    lower: str
    upper: str
    capacity_gbps: float | None = _gbps(None)


class PortIn(_Strict):
    leaf: str
    capacity_gbps: float | None = _gbps(None)


class NicIn(_Strict):
    ports: list[PortIn] = Field(min_length=1, max_length=4)
    ip: ipaddress.IPv4Address | None = None


class NodeIn(_Strict):
    name: str
    nics: list[NicIn] = Field(min_length=1, max_length=64)


class TopologyIn(_Strict):
    version: Literal[1] = 1
    name: str = Field("fabric", min_length=1, max_length=128)
    port_speed_gbps: float = _gbps(200.0)
    """Default capacity of ports and cables that do not give one."""
    fat_tree: FatTreeIn | None = None
    switches: list[SwitchIn] = Field(default_factory=list)
    cables: list[CableIn] = Field(default_factory=list)
    nodes: list[NodeIn] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_form(self) -> TopologyIn:
        explicit = bool(self.switches or self.cables or self.nodes)
        if self.fat_tree is not None and explicit:
            raise ValueError("give either fat_tree or switches/cables/nodes, not both")
        if self.fat_tree is None and not (self.switches and self.nodes):
            raise ValueError("needs fat_tree, or switches and nodes")
        return self


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "topology"
    return f"{loc}: {err['msg']}"


def topology_from_dict(data: Any) -> Topology:
    """Validate a parsed topology document and build the :class:`Topology`."""
    if not isinstance(data, dict):
        raise TopologyError("topology: expected a mapping at the top level")
    try:
        doc = TopologyIn.model_validate(data)
    except ValidationError as exc:
        raise TopologyError(_one_line(exc)) from None
    if doc.fat_tree is not None:
        spec = FatTreeSpec(**doc.fat_tree.model_dump(), name=doc.name)
        return build_fat_tree(spec)
    speed = doc.port_speed_gbps
    known = {s.name for s in doc.switches}
    for i, c in enumerate(doc.cables):
        for end, name in (("lower", c.lower), ("upper", c.upper)):
            if name not in known:
                raise TopologyError(f"cables.{i}.{end}: unknown switch {name!r}")
    for i, n in enumerate(doc.nodes):
        for k, nic in enumerate(n.nics):
            for p, port in enumerate(nic.ports):
                if port.leaf not in known:
                    raise TopologyError(
                        f"nodes.{i}.nics.{k}.ports.{p}.leaf: unknown switch {port.leaf!r}"
                    )
    return Topology(
        name=doc.name,
        switches=tuple(SwitchSpec(name=s.name, tier=s.tier) for s in doc.switches),
        cables=tuple(CableSpec(c.lower, c.upper, c.capacity_gbps or speed) for c in doc.cables),
        nodes=tuple(
            NodeSpec(
                name=n.name,
                nics=tuple(
                    NicSpec(
                        ports=tuple(PortSpec(p.leaf, p.capacity_gbps or speed) for p in nic.ports),
                        ip=int(nic.ip) if nic.ip is not None else None,
                    )
                    for nic in n.nics
                ),
            )
            for n in doc.nodes
        ),
        meta={"source": "file"},
    )


def parse_document(text: str, *, suffix: str = "") -> Any:
    """JSON for ``.json``, YAML otherwise (YAML is a superset of JSON)."""
    try:
        return load_document(text, suffix=suffix)
    except Unparsable as exc:
        raise TopologyError(f"cannot parse: {exc.reason}") from None


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    try:
        text = read_text(p)
    except Unreadable as exc:
        raise TopologyError(f"{p}: {exc.reason}") from None
    try:
        return topology_from_dict(parse_document(text, suffix=p.suffix))
    except TopologyError as exc:
        raise TopologyError(f"{p}: {exc}") from None


@dataclass(kw_only=True, slots=True)
class LabelFabric:
    """The switch layer above the leaves, which node labels cannot describe."""

    spines: int = 8
    """Spine switches; every leaf has one cable to each."""
    oversubscription: float = 1.0
    """A leaf's downlink capacity over its uplink capacity (2.0 = 2:1)."""
    port_speed_gbps: float = 200.0
    """NIC port speed when a node has no port-speed label."""
    name: str = "labels"

    def out_of_range(self) -> str | None:
        """What is outside the bounds a label fabric is built within, or None."""
        if (
            1 <= self.spines <= MAX_LABEL_SPINES
            and 0 < self.oversubscription < math.inf
            and MIN_GBPS <= self.port_speed_gbps <= MAX_GBPS
        ):
            return None
        return (
            f"spines 1..{MAX_LABEL_SPINES}, oversubscription finite > 0, "
            f"port_speed_gbps in [{MIN_GBPS:g}, {MAX_GBPS:g}]"
        )


def topology_from_labels(labels: Mapping[str, Mapping[str, str]], fabric: LabelFabric) -> Topology:
    """Build a two-tier topology from node → labels; nodes without NIC labels are skipped."""
    if (problem := fabric.out_of_range()) is not None:
        raise TopologyError(f"label fabric: {problem}")
    nodes: list[NodeSpec] = []
    down: dict[str, float] = {}
    for node in sorted(labels):
        mine = {
            k[len(LABEL_PREFIX) :]: v for k, v in labels[node].items() if k.startswith(LABEL_PREFIX)
        }
        speed = fabric.port_speed_gbps
        if "port-speed-gbps" in mine:
            try:
                speed = float(mine.pop("port-speed-gbps"))
            except ValueError:
                raise TopologyError(
                    f"node {node!r}: {LABEL_PREFIX}port-speed-gbps is not a number"
                ) from None
            if not MIN_GBPS <= speed <= MAX_GBPS:
                raise TopologyError(
                    f"node {node!r}: {LABEL_PREFIX}port-speed-gbps must be in "
                    f"[{MIN_GBPS:g}, {MAX_GBPS:g}]"
                )
        nics: dict[int, NicSpec] = {}
        for key, value in mine.items():
            m = _NIC_LABEL.fullmatch(key)
            if not m:
                raise TopologyError(f"node {node!r}: unknown label {LABEL_PREFIX}{key}")
            leaves = [v.strip() for v in value.split(",")]
            if not all(leaves) or len(leaves) > 4:
                raise TopologyError(f"node {node!r}: {LABEL_PREFIX}{key} needs 1-4 leaf names")
            nics[int(m.group(1))] = NicSpec(ports=tuple(PortSpec(leaf, speed) for leaf in leaves))
            for leaf in leaves:
                down[leaf] = down.get(leaf, 0.0) + speed
        if not nics:
            continue
        if sorted(nics) != list(range(len(nics))):
            raise TopologyError(f"node {node!r}: NIC labels must be nic0..nic{len(nics) - 1}")
        nodes.append(NodeSpec(name=node, nics=tuple(nics[k] for k in range(len(nics)))))
    if not nodes:
        raise TopologyError(f"no node carries {LABEL_PREFIX}nic<k> labels")
    spines = [f"spine-{j:03d}" for j in range(fabric.spines)]
    switches = [SwitchSpec(name=leaf, tier=1) for leaf in sorted(down)]
    switches += [SwitchSpec(name=s, tier=2) for s in spines]
    cables = [
        CableSpec(leaf, s, down[leaf] / fabric.oversubscription / fabric.spines)
        for leaf in sorted(down)
        for s in spines
    ]
    return Topology(
        name=fabric.name,
        switches=tuple(switches),
        cables=tuple(cables),
        nodes=tuple(nodes),
        meta={"source": "labels"},
    )


__all__ = [
    "LABEL_PREFIX",
    "MAX_GBPS",
    "MAX_LABEL_SPINES",
    "MIN_GBPS",
    "LabelFabric",
    "load_topology",
    "parse_document",
    "topology_from_dict",
    "topology_from_labels",
]
