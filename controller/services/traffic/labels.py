"""The fabric from node labels: for clusters whose nodes say which leaf each NIC is cabled to.

Agents report their node's labels; nodes labelled ``topology.trainguard.io/nic<k>:
leafA[,leafB]`` describe their own NICs, and the ``topology_labels`` setting supplies what no
node can know (spine count, oversubscription, default port speed). The fabric is rebuilt
when the labelled nodes or their labels change; the service then re-plans every plan on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from controller.errors import BadConfig
from controller.logic.traffic.topofile import (
    LABEL_PREFIX,
    LabelFabric,
    topology_from_labels,
)
from controller.logic.traffic.topology import Topology
from controller.state import ClusterState

#: Longest fabric name (as ``TopologyIn.name`` of a topology file).
MAX_NAME_LEN = 128

LabelKey = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


def label_fabric(raw: Mapping[str, Any] | None) -> LabelFabric | None:
    """The ``topology_labels`` setting as a ``LabelFabric``; bad values stop the start."""
    if raw is None:
        return None
    known = {"spines", "oversubscription", "port_speed_gbps", "name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadConfig(f"topology_labels.{unknown[0]}: unknown key (use {sorted(known)})")
    # ``int()`` and ``float()`` alone took ``spines: 2.7`` as 2 spines and ``true`` as 1 (a
    # fabric other than the one written, planned on in silence); and the name is shown with
    # every plan, so it is bounded as a topology file's is.
    spines = raw.get("spines", 8)
    if isinstance(spines, float) and math.isfinite(spines) and not spines.is_integer():
        raise BadConfig(f"topology_labels: spines must be a whole number, got {spines!r}")
    for key in ("spines", "oversubscription", "port_speed_gbps"):
        if isinstance(raw.get(key), bool):
            raise BadConfig(f"topology_labels: {key} must be a number, got {raw[key]!r}")
    name = raw.get("name", "labels")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LEN:
        raise BadConfig(f"topology_labels: name must be a string of 1 to {MAX_NAME_LEN} characters")
    try:
        fabric = LabelFabric(
            spines=int(spines),
            oversubscription=float(raw.get("oversubscription", 1.0)),
            port_speed_gbps=float(raw.get("port_speed_gbps", 200.0)),
            name=name,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadConfig(f"topology_labels: {exc}") from None
    if (problem := fabric.out_of_range()) is not None:
        raise BadConfig(f"topology_labels: {problem}")
    return fabric


class LabelSource:
    def __init__(self, state: ClusterState, fabric: LabelFabric) -> None:
        self._state = state
        self.fabric = fabric

    def _labels(self) -> dict[str, dict[str, str]]:
        out = {}
        for name, node in self._state.nodes.items():
            mine = {k: v for k, v in node.labels.items() if k.startswith(LABEL_PREFIX)}
            if mine:
                out[name] = mine
        return out

    def key(self) -> LabelKey:
        """Changes exactly when the fabric the labels describe may have changed."""
        return tuple(
            (n, tuple(sorted(labels.items()))) for n, labels in sorted(self._labels().items())
        )

    def build(self) -> Topology:
        return topology_from_labels(self._labels(), self.fabric)


__all__ = ["LabelKey", "LabelSource", "label_fabric"]
