"""From a slow-link finding to fabric links: which links to mark slow before re-planning.

The detectors' probe round times rank pairs and reports which pairs are slow; only the plan
knows which links each pair's traffic crosses. A link on every slow pair's planned paths and
on no healthy pair's paths is the suspect (C4D's "common to slow pairs" rule, one level
down). The policy then calls ``Planner.replan(plan, [(link, measured / expected), ...])``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from controller.logic.traffic.errors import JobSpecError
from controller.logic.traffic.planner import Plan


def rank_nic(plan: Plan, rank: int) -> tuple[int, int]:
    """(node index, NIC index) the rank's network traffic uses under this plan's order."""
    job, topo = plan.job, plan.topology
    if not 0 <= rank < job.world:
        raise JobSpecError(f"rank {rank} is outside the job's {job.world} ranks")
    node = topo.node_index[plan.node_order[rank // job.gpus_per_node]]
    nics = len(topo.ports[node])
    return node, (rank % job.gpus_per_node) * nics // job.gpus_per_node


def pair_links(plan: Plan, a: int, b: int) -> set[int]:
    """Links the probe traffic between ranks a and b crosses, as far as the plan tells.

    The planned flows from a's NIC to b's NIC, where there are any. Where there are none
    (the ring crosses nodes NIC k to NIC k, so a probe pair from one rail to another is
    never planned, the common case on one-NIC-per-GPU servers), the access links of both
    NICs, each way (the probe is a ping-pong): whatever route the transfer took, it crossed
    one of those. Ranks on one node talk over NVLink/PCIe: no fabric link (empty).
    """
    (sn, sk), (dn, dk) = rank_nic(plan, a), rank_nic(plan, b)
    fl = plan.flows
    mask = (fl.src_node == sn) & (fl.src_nic == sk) & (fl.dst_node == dn) & (fl.dst_nic == dk)
    rows = plan.paths()[mask]
    if len(rows) or sn == dn:
        return {int(x) for x in np.unique(rows) if x != plan.topology.dummy_link}
    refs = [*plan.topology.ports[sn][sk], *plan.topology.ports[dn][dk]]
    return {r.up_link for r in refs} | {r.down_link for r in refs}


def suspect_links(
    plan: Plan, slow_pairs: Iterable[tuple[int, int]], ok_pairs: Iterable[tuple[int, int]] = ()
) -> list[str]:
    """Links common to the slow pairs' paths and absent from the healthy pairs' paths;
    when the slow pairs share nothing, any of their links no healthy pair uses."""
    slow = [pair_links(plan, a, b) for a, b in slow_pairs]
    slow = [s for s in slow if s]
    if not slow:
        return []
    healthy: set[int] = set()
    for a, b in ok_pairs:
        healthy |= pair_links(plan, a, b)
    common = set.intersection(*slow) - healthy
    found = common or set.union(*slow) - healthy
    return sorted(plan.topology.link_names[i] for i in found)


__all__ = ["pair_links", "rank_nic", "suspect_links"]
