"""What the API shows of the service: the fabric's state and plans, as JSON-ready dicts.

Plans hold numpy arrays and the planner's candidate sets; these functions pick what an
operator and a launcher need (rank order, NCCL settings, per-node source ports, the busiest
link, the version history) and leave the rest in the service.
"""

from __future__ import annotations

from typing import Any

from controller.errors import NotFound
from controller.logic.traffic import records
from controller.logic.traffic.outputs import qp_map
from controller.services.traffic.placement import Layout
from controller.services.traffic.service import DOC_ONLY, LivePlan, TrafficService


def topology_summary(service: TrafficService) -> dict[str, Any]:
    topo = service.need_topology()
    down = [n for i, n in enumerate(topo.link_names) if topo.health[i] == 0]
    slow = [
        {"link": n, "capacity_factor": float(topo.health[i])}
        for i, n in enumerate(topo.link_names)
        if 0 < topo.health[i] < 1
    ]
    return {
        **topo.summary(),
        "switches": sorted(topo.tier),
        "down_links": down,
        "slow_links": slow,
        "plans": len(service.plans),
    }


def brief(live: LivePlan) -> dict[str, Any]:
    plan = live.plan
    stats = records.summary(plan)
    return {
        "plan_id": plan.plan_id,
        "job": plan.job.name,
        "version": plan.version,
        "created_unix_s": plan.created_unix_s,
        "nodes": len(plan.node_order),
        "flows": stats["flows"],
        "max_link_time_s": stats["max_link_time_s"],
        "max_link_load_bytes": stats["max_link_load_bytes"],
        "busiest_link": stats["busiest_link"],
        "moved_flows": stats["moved_flows"],
        "proven_optimal": stats["proven_optimal"],
    }


def list_plans(service: TrafficService) -> list[dict[str, Any]]:
    return [brief(live) for live in sorted(service.plans.values(), key=lambda p: p.plan.job.name)]


def plan_detail(service: TrafficService, plan_id: str) -> dict[str, Any]:
    live = service.plans.get(plan_id)
    if live is None:
        raise NotFound(f"plan {plan_id!r} not found")
    plan = live.plan
    ports = qp_map(plan, live.sports, service.hash)
    return {
        **brief(live),
        "parent_version": plan.parent_version,
        "layout": {k: getattr(plan.job, k) for k in Layout.__dataclass_fields__},
        "launcher_order": live.versions[-1]["launcher_order"],
        "nccl_env": live.versions[-1]["nccl_env"],
        "stats": records.summary(plan),
        "changes": plan.changes,
        "versions": [{k: v for k, v in d.items() if k not in DOC_ONLY} for d in live.versions],
        "source_ports": {"hash": ports["hash"], "nodes": ports["nodes"]},
    }


__all__ = ["brief", "list_plans", "plan_detail", "topology_summary"]
