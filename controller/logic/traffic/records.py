"""Plans as stored rows and back: what survives a controller restart.

A stored version holds the job spec in the plan's node order, every flow's path (link
indices) and UDP source port, plus the summary the API shows. Restoring rebuilds the flows
from the spec, enumerates candidates on the live fabric and picks, for every flow, the
candidate whose links are the stored path, so the restored plan is the same object the
planner would hold, ready for the next re-plan. Indices are only meaningful on the same
fabric, so a version also records a fingerprint of the link names; if the fabric changed
(or a stored path is no longer a live candidate) restoring returns None and the service
plans the job afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import TrafficError
from controller.logic.traffic.jobs import JobSpec, build_flows
from controller.logic.traffic.outputs import launcher_order, nccl_env
from controller.logic.traffic.planner import Plan, Planner, chosen_rows
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]


def fingerprint(topo: Topology) -> str:
    return hashlib.sha256("\n".join(topo.link_names).encode()).hexdigest()[:16]


def summary(plan: Plan) -> dict[str, Any]:
    """Busiest link and friends, plus the load in bytes the API calls "max link load"."""
    stats = plan.stats()
    busiest = stats.get("busiest_link")
    index = plan.topology.link_index.get(busiest) if isinstance(busiest, str) else None
    load = float(plan.loads_bytes[index]) if index is not None else 0.0
    return {**stats, "max_link_load_bytes": load}


def to_document(
    plan: Plan,
    sports: IntArray,
    *,
    trigger: str,
    replan_ms: float | None,
    new_changes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    topo = plan.topology
    dummy = topo.dummy_link
    paths = plan.paths()
    return {
        "plan_id": plan.plan_id,
        "version": plan.version,
        "parent_version": plan.parent_version,
        "created_unix_s": plan.created_unix_s,
        "job": plan.job.name,
        "trigger": trigger,
        "replan_ms": replan_ms,
        "stats": summary(plan),
        "changes": plan.changes,
        "new_changes": list(new_changes or []),
        "launcher_order": launcher_order(plan),
        "nccl_env": nccl_env(plan),
        "spec": dataclasses.asdict(plan.job),
        "topology": {"name": topo.name, "fingerprint": fingerprint(topo)},
        "paths": [[int(x) for x in row if x != dummy] for row in paths],
        "sports": [int(x) for x in sports],
    }


def version_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """One line of a plan's version history."""
    stats = doc.get("stats", {})
    return {
        "version": doc["version"],
        "parent_version": doc.get("parent_version"),
        "created_unix_s": doc["created_unix_s"],
        "trigger": doc.get("trigger", ""),
        "moved_flows": stats.get("moved_flows", 0),
        "reported_flows": stats.get("reported_flows", 0),
        "replan_ms": doc.get("replan_ms"),
        "plan_time_s": stats.get("plan_time_s"),
        "max_link_time_s": stats.get("max_link_time_s"),
        "changes": doc.get("new_changes", []),
    }


def restore(planner: Planner, doc: dict[str, Any]) -> tuple[Plan, IntArray] | None:
    """The stored version as a live plan on ``planner``'s fabric, or None if it no longer fits."""
    topo = planner.topo
    if doc.get("topology", {}).get("fingerprint") != fingerprint(topo):
        return None
    spec = JobSpec(**doc["spec"])
    try:
        spec.validate(topo)
        flows = build_flows(spec, topo)
        if len(flows) != len(doc["paths"]) or len(flows) != len(doc["sports"]):
            return None
        sets, set_of = planner.candidate_sets(flows)
    except TrafficError:
        return None
    dummy = topo.dummy_link
    lookup = [
        {tuple(int(x) for x in row if x != dummy): c for c, row in enumerate(cs.links)}
        for cs in sets
    ]
    choice = np.zeros(len(flows), dtype=np.int64)
    for f, path in enumerate(doc["paths"]):
        c = lookup[set_of[f]].get(tuple(path))
        if c is None:
            return None
        choice[f] = c
    matrix = chosen_rows(sets, set_of, choice) if len(flows) else np.zeros((0, 1), np.int64)
    loads = np.zeros(topo.n_links + 1, dtype=np.float64)
    if len(flows):
        np.add.at(loads, matrix, flows.size_bytes[:, None])
    loads[-1] = 0.0
    stats = doc.get("stats", {})
    plan = Plan(
        plan_id=doc["plan_id"],
        version=int(doc["version"]),
        parent_version=doc.get("parent_version"),
        created_unix_s=float(doc["created_unix_s"]),
        topology=topo,
        job=spec,
        node_order=list(spec.nodes),
        flows=flows,
        sets=sets,
        set_of=set_of,
        choice=choice,
        loads_bytes=loads,
        plan_time_s=float(stats.get("plan_time_s") or 0.0),
        moved_flows=int(stats.get("moved_flows") or 0),
        hash_moved_flows=int(stats.get("hash_moved_flows") or 0),
        reported_flows=int(stats.get("reported_flows") or 0),
        proven_optimal=bool(stats.get("proven_optimal")),
        changes=list(doc.get("changes", [])),
        path_matrix=matrix,
    )
    return plan, np.asarray(doc["sports"], dtype=np.int64)


__all__ = ["fingerprint", "restore", "summary", "to_document", "version_summary"]
