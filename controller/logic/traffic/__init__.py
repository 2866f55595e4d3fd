"""Traffic planning, C4P-style: a fabric model, a path/bond-port planner, a flow simulator
and the outputs that enforce a plan (rank order, per-QP source ports, NCCL settings).

Collective traffic is a few large, long-lived, predictable flows, so ECMP's random hashing
lets several of them share one uplink while others idle. The planner assigns every flow a
path and bond port; :mod:`.enforce` turns paths into UDP source ports under a modelled hash.

Modules: ``topology`` (model), ``fattree`` / ``topofile`` (builders, file and label
loaders), ``jobs`` (flows from placement and parallel layout, ring order), ``routes``
(candidate paths), ``planner``, ``hashing`` / ``enforce``, ``sim`` / ``compare`` (max-min
fair simulator, ECMP vs plan vs ideal), ``outputs`` (JSON, QP map, NCCL env), ``localize``
(slow-link findings to fabric links), ``lp`` (optional LP relaxation), ``cli`` and
``cli_api`` (``trainguard plan …``). Inside the controller: ``service`` (fabric, versioned
plans, link health), ``slowlink`` (reacting to slow-link incidents), ``views`` (what the
API shows), ``labels`` (the fabric from node labels), ``placement`` (reported placement to
``JobSpec``, launched ranks to plan ranks), ``records`` (plans as stored rows and back).
Errors: see :mod:`.errors`. Names below load lazily, so ``import trainguard.cli.cmd_plan``
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.logic.traffic.compare import SimConfig, compare
    from controller.logic.traffic.enforce import enforce
    from controller.logic.traffic.errors import (
        EnforcementError,
        JobSpecError,
        PlanError,
        TopologyError,
        TrafficError,
    )
    from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
    from controller.logic.traffic.hashing import HashConfig
    from controller.logic.traffic.jobs import JobSpec, build_flows
    from controller.logic.traffic.localize import suspect_links
    from controller.logic.traffic.planner import Plan, Planner, PlannerConfig
    from controller.logic.traffic.topofile import LabelFabric, load_topology, topology_from_labels
    from controller.logic.traffic.topology import Topology

_EXPORTS = {
    "SimConfig": "compare",
    "compare": "compare",
    "enforce": "enforce",
    "EnforcementError": "errors",
    "JobSpecError": "errors",
    "PlanError": "errors",
    "TopologyError": "errors",
    "TrafficError": "errors",
    "FatTreeSpec": "fattree",
    "build_fat_tree": "fattree",
    "HashConfig": "hashing",
    "JobSpec": "jobs",
    "build_flows": "jobs",
    "Plan": "planner",
    "Planner": "planner",
    "PlannerConfig": "planner",
    "LabelFabric": "topofile",
    "load_topology": "topofile",
    "topology_from_labels": "topofile",
    "Topology": "topology",
    "suspect_links": "localize",
}

__all__ = [
    "EnforcementError",
    "FatTreeSpec",
    "HashConfig",
    "JobSpec",
    "JobSpecError",
    "LabelFabric",
    "Plan",
    "PlanError",
    "Planner",
    "PlannerConfig",
    "SimConfig",
    "Topology",
    "TopologyError",
    "TrafficError",
    "build_fat_tree",
    "build_flows",
    "compare",
    "enforce",
    "load_topology",
    "suspect_links",
    "topology_from_labels",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'controller.logic.traffic' has no attribute {name!r}")
    return getattr(importlib.import_module(f"controller.logic.traffic.{module}"), name)
