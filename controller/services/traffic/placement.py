"""From what the controller knows about a running job to the planner's terms, and back.

The job's placement (which node runs which ranks) comes from the ranks' own reports; its
parallel layout comes from the operator. Slow-link findings name rank pairs *as launched*;
the plan numbers ranks in its own node order, so pairs are translated through the nodes:
the k-th lowest rank on a node is that node's k-th GPU in the plan. If the job still runs
in another order than the plan's, its slow pairs may have no planned flows and then yield no
suspect links, which is the honest answer (the plan does not describe that traffic).

Errors are the controller's own: 409 when the reports contradict the fabric or are not
complete yet, 422 naming ``body.layout`` when the layout does not fit the placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.errors import Conflict, InvalidInput
from controller.logic.detection.c4d.job_evidence import SlowLinkEvidence
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.localize import suspect_links
from controller.logic.traffic.planner import Plan
from controller.logic.traffic.topology import Topology
from controller.state import JobState

#: A slow-link finding marks links at the measured bandwidth ratio, kept inside these bounds
#: (a ratio of 0 would be "down", which only an operator or a failed link should decide).
MIN_SLOW_FACTOR, MAX_SLOW_FACTOR, DEFAULT_SLOW_FACTOR = 0.05, 0.95, 0.5


@dataclass(kw_only=True, slots=True)
class Layout:
    """Parallel layout of a job (what its placement cannot tell); see ``JobSpec``."""

    tp: int = 1
    pp: int = 1
    grad_bytes: int = 1 << 30
    pp_bytes: int = 0
    tp_bytes: int = 0
    channels: int = 2
    qps_per_connection: int = 1

    def fields(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in Layout.__dataclass_fields__}


def nodes_of(job: JobState) -> tuple[list[str], int]:
    """Nodes in order of their lowest rank, and ranks per node, from the ranks' reports."""
    world = job.world_size or len(job.ranks)
    if len(job.ranks) < world:
        raise Conflict(
            f"job {job.name!r}: {len(job.ranks)} of {world} ranks have reported; "
            "the placement is not known yet"
        )
    per_node: dict[str, list[int]] = {}
    for rank in sorted(job.ranks):
        per_node.setdefault(job.ranks[rank].node, []).append(rank)
    counts = {len(r) for r in per_node.values()}
    if len(counts) != 1:
        raise Conflict(f"job {job.name!r}: nodes run different numbers of ranks ({sorted(counts)})")
    return list(per_node), counts.pop()


def job_spec(job: JobState, layout: Layout, topo: Topology) -> JobSpec:
    nodes, gpn = nodes_of(job)
    missing = [n for n in nodes if n not in topo.node_index]
    if missing:
        raise Conflict(
            f"job {job.name!r} runs on nodes not in topology {topo.name!r}: {missing[:5]}"
        )
    world = len(nodes) * gpn
    if world % (layout.tp * layout.pp):
        raise InvalidInput(
            f"body.layout: tp*pp={layout.tp * layout.pp} does not divide the job's {world} ranks"
        )
    return JobSpec(name=job.name, nodes=nodes, gpus_per_node=gpn, **layout.fields())


def plan_ranks(plan: Plan, job: JobState) -> dict[int, int]:
    """Job rank (as launched) -> rank in the plan's node order, through the placement."""
    gpn = plan.job.gpus_per_node
    where = {n: i for i, n in enumerate(plan.node_order)}
    by_node: dict[str, list[int]] = {}
    for rank in sorted(job.ranks):
        by_node.setdefault(job.ranks[rank].node, []).append(rank)
    out: dict[int, int] = {}
    for node, ranks in by_node.items():
        if node in where:
            out.update({r: where[node] * gpn + k for k, r in enumerate(ranks) if k < gpn})
    return out


def slow_link_suspects(
    plan: Plan, job: JobState, evidence: SlowLinkEvidence
) -> tuple[list[str], float]:
    """Fabric links behind a ``slow_link`` incident, and the bandwidth ratio to mark them at.

    Probe pairs that all failed (scope ``failed``) say a rank is gone, not that a link is
    slow, so they mark nothing.
    """
    if evidence.scope == "failed":
        return [], 1.0
    gbps: dict[tuple[int, int], float] = {}
    for key, value in evidence.pair_gbps.items():
        a, _, b = key.partition("-")
        gbps[(int(a), int(b))] = value
    slow = [(a, b) for a, b in evidence.slow_pairs]
    ok = [p for p in gbps if p not in set(slow)]
    to_plan = plan_ranks(plan, job)
    slow_p = [(to_plan[a], to_plan[b]) for a, b in slow if a in to_plan and b in to_plan]
    ok_p = [(to_plan[a], to_plan[b]) for a, b in ok if a in to_plan and b in to_plan]
    median = evidence.median_gbps
    rates = [gbps[p] for p in slow if p in gbps]
    factor = min(rates) / median if rates and median > 0 else DEFAULT_SLOW_FACTOR
    factor = min(MAX_SLOW_FACTOR, max(MIN_SLOW_FACTOR, factor))
    return suspect_links(plan, slow_p, ok_p), factor


__all__ = ["Layout", "job_spec", "nodes_of", "plan_ranks", "slow_link_suspects"]
