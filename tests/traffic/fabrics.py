"""Fabric description files the controller tests start with (``topology_file``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from controller.logic.traffic.jobs import JobSpec


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


def two_tier(
    leaves: dict[str, list[str]],
    spines: int,
    *,
    cables: list[dict[str, Any]] | None = None,
    gbps: float = 100.0,
) -> dict[str, Any]:
    """A two-tier fabric document: ``leaves`` maps leaf -> its nodes (one single-port NIC
    each), every leaf cabled to every spine unless ``cables`` says otherwise."""
    spine_names = [f"s{j}" for j in range(spines)]
    return {
        "name": "sweep",
        "port_speed_gbps": gbps,
        "switches": [{"name": leaf, "tier": 1} for leaf in leaves]
        + [{"name": s, "tier": 2} for s in spine_names],
        "cables": cables
        if cables is not None
        else [{"lower": leaf, "upper": s} for leaf in leaves for s in spine_names],
        "nodes": [
            {"name": n, "nics": [{"ports": [{"leaf": leaf}]}]}
            for leaf, nodes in leaves.items()
            for n in nodes
        ],
    }


def ring_job(nodes: list[str], channels: int = 1, grad_bytes: int = 1 << 30) -> JobSpec:
    """A data-parallel ring over ``nodes``, one GPU each."""
    return JobSpec(nodes=nodes, gpus_per_node=1, tp=1, channels=channels, grad_bytes=grad_bytes)
