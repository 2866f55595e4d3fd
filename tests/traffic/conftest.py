"""Small fabrics shared by the traffic tests (fixture names prefixed to stay unique)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
from controller.logic.traffic.topology import Topology


def small_fabric(**kw: object) -> Topology:
    spec = {"nodes": 16, "nics_per_node": 2, "ports_per_nic": 2, "nodes_per_leaf": 4}
    spec.update(kw)
    return build_fat_tree(FatTreeSpec(**spec))  # type: ignore[arg-type]


@pytest.fixture
def traffic_fabric() -> Topology:
    return small_fabric()


@pytest.fixture
def traffic_fabric_file(tmp_path: Path) -> Path:
    """Two leaves, two spines, four one-NIC nodes (tg-0, tg-1 on tor-a; tg-2, tg-3 on tor-b)."""
    leaf = {"tg-0": "tor-a", "tg-1": "tor-a", "tg-2": "tor-b", "tg-3": "tor-b"}
    doc = {
        "name": "lab",
        "port_speed_gbps": 100,
        "switches": [{"name": n, "tier": 1} for n in ("tor-a", "tor-b")]
        + [{"name": n, "tier": 2} for n in ("spine-0", "spine-1")],
        "cables": [
            {"lower": lo, "upper": up} for lo in ("tor-a", "tor-b") for up in ("spine-0", "spine-1")
        ],
        "nodes": [{"name": n, "nics": [{"ports": [{"leaf": leaf[n]}]}]} for n in sorted(leaf)],
    }
    path = tmp_path / "fabric.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
