"""Fabric description files the controller tests start with (``topology_file``)."""

from __future__ import annotations

from pathlib import Path

import yaml


def lab_fabric_file(directory: Path, prefix: str = "tg") -> Path:
    """Two leaves, two spines, four one-NIC nodes: ``<prefix>-0``, ``-1`` on tor-a and
    ``-2``, ``-3`` on tor-b; written as ``directory/fabric.yaml``."""
    leaf = {f"{prefix}-{i}": "tor-a" if i < 2 else "tor-b" for i in range(4)}
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
    path = directory / "fabric.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
