"""Checks on plans that several traffic tests share: flows between named nodes, and the
exhaustive optimum a plan is measured against."""

from __future__ import annotations

import numpy as np

from controller.logic.traffic.enforce import walk
from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.jobs import Collective, Flows
from controller.logic.traffic.planner import Plan
from controller.logic.traffic.topology import Topology


def flows_by_index(pairs: list[tuple[int, int]], sizes: list[float]) -> Flows:
    """One flow per ``(src, dst)`` node index pair, NIC 0 to NIC 0, ``sizes`` in bytes."""
    n = len(pairs)
    return Flows(
        src_node=np.asarray([a for a, _ in pairs], dtype=np.int64),
        src_nic=np.zeros(n, dtype=np.int64),
        dst_node=np.asarray([b for _, b in pairs], dtype=np.int64),
        dst_nic=np.zeros(n, dtype=np.int64),
        size_bytes=np.asarray(sizes, dtype=np.float64),
        group=np.zeros(n, dtype=np.int64),
        channel=np.zeros(n, dtype=np.int64),
        qp=np.arange(n, dtype=np.int64),
        collectives=[Collective(name="x", kind="dp", ranks=[0, 1], size_bytes=1)],
    )


def flows_between(topo: Topology, pairs: list[tuple[str, str]], sizes: list[float]) -> Flows:
    """:func:`flows_by_index` for pairs of node names."""
    idx = topo.node_index
    return flows_by_index([(idx[a], idx[b]) for a, b in pairs], sizes)


def brute_force_optimum(plan: Plan) -> float:
    """Smallest busiest-link time over every combination of the plan's candidates
    (exhaustive: a few flows only)."""
    cap = plan.topology.capacity_ext()
    dummy = plan.topology.dummy_link
    partial = np.zeros((1, len(cap)))
    for f in range(len(plan.flows)):
        cs = plan.sets[plan.set_of[f]]
        add = np.zeros((len(cs), len(cap)))
        for c, row in enumerate(cs.links):
            for lk in row:
                if lk != dummy:
                    add[c, lk] += plan.flows.size_bytes[f] / cap[lk]
        partial = (partial[:, None, :] + add[None, :, :]).reshape(-1, len(cap))
    return float(partial.max(axis=1).min())


def walked(plan: Plan, cfg: HashConfig, sports: np.ndarray) -> list[list[int]]:
    """Each flow's links as its packets take them with its source port under ``cfg``."""
    topo, fl, graph = plan.topology, plan.flows, plan.topology.graph()
    return [
        walk(
            topo,
            cfg,
            (int(fl.src_node[f]), int(fl.src_nic[f])),
            (int(fl.dst_node[f]), int(fl.dst_nic[f])),
            int(sports[f]),
            graph,
        )
        for f in range(len(fl))
    ]


def off_plan(plan: Plan, cfg: HashConfig, sports: np.ndarray) -> list[int]:
    """The flows whose packets, with their source ports, leave their planned paths."""
    dummy = plan.topology.dummy_link
    return [
        f
        for f, (links, row) in enumerate(zip(walked(plan, cfg, sports), plan.paths(), strict=True))
        if links != [int(x) for x in row if x != dummy]
    ]
