"""Small fabrics shared by the traffic tests (fixture names prefixed to stay unique)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
from controller.logic.traffic.topology import Topology
from tests.traffic.fabrics import lab_fabric_file


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
    return lab_fabric_file(tmp_path)
