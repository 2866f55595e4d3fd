"""Steering each queue pair onto its planned path by choosing its UDP source port.

For every flow, the planned candidate records the hash decisions that select it (bond port
at the sender, uplink at each switch going up, which next hop going down). A source port is
acceptable when the modelled hash makes every one of those decisions; we evaluate all
ports of the allowed range at once (:func:`.hashing.hash_ports`) and take the first one not
yet used by the same NIC pair, so the queue pairs of one connection stay distinguishable.

:func:`walk` forwards a packet hop by hop the way the fabric would, from shortest-path
next-hop sets computed on the networkx graph, independently of :mod:`.routes`; tests use
it to check that the ports we hand out really land on the planned paths.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import EnforcementError, PlanError
from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.planner import Plan, Planner, PlannerConfig
from controller.logic.traffic.reach import reachable
from controller.logic.traffic.routes import SRC_DEVICE, Choice
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
_WINDOW = 2048


def _acceptable(
    cfg: HashConfig, choices: tuple[Choice, ...], src_dev: str, sip: int, dip: int, ports: IntArray
) -> npt.NDArray[np.bool_]:
    ok = np.ones(ports.shape[0], dtype=bool)
    for device, idx, n in choices:
        host = device == SRC_DEVICE
        ok &= cfg.indices(src_dev if host else device, host, sip, dip, ports, n) == idx
    return ok


def _find_port(
    cfg: HashConfig,
    choices: tuple[Choice, ...],
    src_dev: str,
    sip: int,
    dip: int,
    start: int,
    taken: set[int],
) -> int:
    lo, hi = cfg.sport_min, cfg.sport_max
    span = hi - lo + 1
    for window in (min(_WINDOW, span), span):
        ports = lo + (start + np.arange(window, dtype=np.int64)) % span
        for i in np.flatnonzero(_acceptable(cfg, choices, src_dev, sip, dip, ports)):
            p = int(ports[i])
            if p not in taken:
                return p
        if window == span:
            break
    return -1


def _replan_reachable(plan: Plan, cfg: HashConfig) -> tuple[IntArray, FloatArray]:
    """Plan again (greedy + local search) over only the candidates the hash can reach,
    unless every planned path is reachable already."""
    topo, fl = plan.topology, plan.flows
    _, first = np.unique(plan.set_of, return_index=True)
    masks: dict[int, npt.NDArray[np.bool_]] = {}
    for f in first:
        s = int(plan.set_of[f])
        src = (int(fl.src_node[f]), int(fl.src_nic[f]))
        dst = (int(fl.dst_node[f]), int(fl.dst_nic[f]))
        masks[s] = reachable(topo, cfg, plan.sets[s], src, dst)
    if all(masks[int(s)][c] for s, c in zip(plan.set_of, plan.choice, strict=True)):
        return plan.choice.copy(), plan.loads_bytes.copy()
    penalty = [
        np.where(masks[s], 0.0, np.inf) if s in masks else np.zeros(len(cs))
        for s, cs in enumerate(plan.sets)
    ]
    choice = np.zeros(len(fl), dtype=np.int64)
    loads = np.zeros(topo.n_links + 1, dtype=np.float64)
    planner = Planner(topo, PlannerConfig(reorder_ring=False))
    sizes = fl.size_bytes
    order = np.argsort(-sizes, kind="stable")
    try:
        planner._greedy(order, sizes, plan.sets, plan.set_of, choice, loads, penalty)
    except PlanError:  # a NIC pair none of whose paths the window reaches: keep the plan
        return plan.choice.copy(), plan.loads_bytes.copy()
    planner._local_search(sizes, plan.sets, plan.set_of, choice, loads, penalty=penalty)
    return choice, loads


def enforce(
    plan: Plan, cfg: HashConfig, *, repair_budget_s: float = 1.0, hash_aware: bool = True
) -> tuple[Plan, IntArray]:
    """Give every flow a UDP source port that steers it onto its path under ``cfg``.

    With a linear hash (every CRC is one) some combinations of decisions along a path are
    unreachable by any source port: the devices' output bits are correlated. Such a flow
    is moved to the best candidate that is reachable, scored like the planner does, so the
    returned plan (same id and version) is exactly what the fabric will do. Returns the
    plan and the source port per flow. Raises :class:`EnforcementError` only when a flow
    has no reachable candidate at all.

    Forced moves pile flows onto links that are already full, and hill-climbing cannot
    undo that on a loaded fabric. So with ``hash_aware`` (the default) the plan is first
    redone over reachable candidates only (:mod:`.reach`) whenever some planned path is
    unreachable; what is left (ports taken by sibling QPs) is moved as described and then
    repaired by local search restricted to reachable moves, for ``repair_budget_s``.
    """
    cfg.validate()
    topo = plan.topology
    fl = plan.flows
    cap = topo.capacity_ext()
    choice = plan.choice.copy()
    loads = plan.loads_bytes.copy()
    if hash_aware and len(fl):
        choice, loads = _replan_reachable(plan, cfg)
    out = np.full(len(fl), -1, dtype=np.int64)
    span = cfg.sport_max - cfg.sport_min + 1
    used: dict[tuple[int, int], set[int]] = {}
    for f in range(len(fl)):
        sn, sk = int(fl.src_node[f]), int(fl.src_nic[f])
        dn, dk = int(fl.dst_node[f]), int(fl.dst_nic[f])
        sip, dip = topo.nic_ips[sn][sk], topo.nic_ips[dn][dk]
        cs = plan.sets[plan.set_of[f]]
        src_dev = f"{topo.nodes[sn].name}/nic{sk}"
        taken = used.setdefault((sip, dip), set())
        start = (sip * 2654435761 + dip * 40503 + f) % span
        port = _find_port(cfg, cs.choices[choice[f]], src_dev, sip, dip, start, taken)
        if port < 0:
            size = fl.size_bytes[f]
            loads[cs.links[choice[f]]] -= size
            with np.errstate(divide="ignore", invalid="ignore"):
                u = (loads[cs.links] + size) / cap[cs.links]
            u[np.isnan(u)] = 0.0
            for c in np.argsort(u.max(axis=1) + 1e-3 * u.sum(axis=1), kind="stable"):
                port = _find_port(cfg, cs.choices[c], src_dev, sip, dip, start, taken)
                if port >= 0:
                    choice[f] = c
                    break
            loads[cs.links[choice[f]]] += size
            loads[-1] = 0.0
        if port < 0:
            raise EnforcementError(
                f"flow {f} ({src_dev} -> {topo.nodes[dn].name}/nic{dk}): no source port in "
                f"{cfg.sport_min}..{cfg.sport_max} makes the {cfg.function} hash pick any path"
            )
        taken.add(port)
        out[f] = port

    def accept(f: int, c: int) -> bool:
        sn, sk = int(fl.src_node[f]), int(fl.src_nic[f])
        dn, dk = int(fl.dst_node[f]), int(fl.dst_nic[f])
        sip, dip = topo.nic_ips[sn][sk], topo.nic_ips[dn][dk]
        taken = used[(sip, dip)]
        start = (sip * 2654435761 + dip * 40503 + f) % span
        cs = plan.sets[plan.set_of[f]]
        port = _find_port(
            cfg, cs.choices[c], f"{topo.nodes[sn].name}/nic{sk}", sip, dip, start, taken
        )
        if port < 0:
            return False
        taken.discard(int(out[f]))
        taken.add(port)
        out[f] = port
        return True

    if (choice != plan.choice).any() and repair_budget_s > 0:
        repair = Planner(topo, PlannerConfig(reorder_ring=False))
        repair._local_search(
            fl.size_bytes,
            plan.sets,
            plan.set_of,
            choice,
            loads,
            accept=accept,
            budget_s=repair_budget_s,
        )
    moved = int((choice != plan.choice).sum())  # planned path unreachable: moved
    enforced = dataclasses.replace(
        plan,
        choice=choice,
        loads_bytes=loads,
        hash_moved_flows=moved,
        path_matrix=None,
        # a proof about the planned paths says nothing about paths the hash forced
        proven_optimal=plan.proven_optimal and moved == 0,
    )
    return enforced, out


def enforce_changed(
    plan: Plan, cfg: HashConfig, previous_sports: IntArray, changed: IntArray
) -> tuple[Plan, IntArray] | None:
    """Source ports after a re-plan that moved only ``changed`` flows.

    The flows the re-plan lists in ``plan.reported`` kept their paths, but an equal-cost
    group their hash decisions go through changed size, so their ports may now hash
    elsewhere: they get new ports too. Every other flow keeps its path and its decisions, so
    its port still steers it. Ports are chosen as :func:`enforce` does, among ports their
    siblings do not hold. Returns None when some such flow's path is unreachable by any free
    port, in which case the caller runs :func:`enforce` (which may move it to a reachable
    candidate). Finding ports for a handful of flows instead of all of them is what keeps a
    re-plan at milliseconds.
    """
    cfg.validate()
    topo, fl = plan.topology, plan.flows
    sports = previous_sports.copy()
    moving = {int(f) for f in changed} | {int(f) for f in plan.reported}
    if not moving:
        return plan, sports
    span = cfg.sport_max - cfg.sport_min + 1
    pair = [
        (topo.nic_ips[int(fl.src_node[f])][int(fl.src_nic[f])],
         topo.nic_ips[int(fl.dst_node[f])][int(fl.dst_nic[f])])
        for f in range(len(fl))
    ]  # fmt: skip
    used: dict[tuple[int, int], set[int]] = {}
    for f in range(len(fl)):
        if f not in moving:
            used.setdefault(pair[f], set()).add(int(sports[f]))
    for f in sorted(moving):
        sip, dip = pair[f]
        sn, sk = int(fl.src_node[f]), int(fl.src_nic[f])
        cs = plan.sets[plan.set_of[f]]
        taken = used.setdefault((sip, dip), set())
        start = (sip * 2654435761 + dip * 40503 + f) % span
        port = _find_port(
            cfg,
            cs.choices[plan.choice[f]],
            f"{topo.nodes[sn].name}/nic{sk}",
            sip,
            dip,
            start,
            taken,
        )
        if port < 0:
            return None
        taken.add(port)
        sports[f] = port
    return plan, sports


def walk(
    topo: Topology,
    cfg: HashConfig,
    src: tuple[int, int],
    dst: tuple[int, int],
    sport: int,
    graph: nx.DiGraph | None = None,
) -> list[int]:
    """Links a packet from NIC ``src`` to NIC ``dst`` with this source port traverses.

    At each device the next hops are the neighbours one step closer to the destination
    NIC over live links, ordered by link name (for NIC → port edges, by port name); the
    modelled hash of the device picks one.
    """
    g = topo.graph() if graph is None else graph
    live = nx.DiGraph()
    for u, v, data in g.edges(data=True):
        lk = data.get("link")
        if lk is None or topo.health[lk] > 0:
            live.add_edge(u, v, **data)
    src_dev = f"{topo.nodes[src[0]].name}/nic{src[1]}"
    dst_dev = f"{topo.nodes[dst[0]].name}/nic{dst[1]}"
    dist = nx.single_source_shortest_path_length(live.reverse(copy=False), dst_dev)
    sip, dip = topo.nic_ips[src[0]][src[1]], topo.nic_ips[dst[0]][dst[1]]
    here = src_dev
    links: list[int] = []
    if here not in dist:
        raise EnforcementError(f"{src_dev} cannot reach {dst_dev}")
    hops = 0
    while here != dst_dev:
        hops += 1
        if hops > live.number_of_nodes():
            # The bond hashed onto a port whose only way on leads back through the NIC
            # (a port with no route of its own): the packet would circle for ever.
            raise EnforcementError(f"{src_dev} -> {dst_dev}: port {sport} loops at {here}")
        if here == src_dev:  # the bond hashes over every live port, near or far
            nxt = [v for v in live.successors(here) if v in dist]
        else:
            nxt = [v for v in live.successors(here) if dist.get(v, -1) == dist[here] - 1]
        nxt.sort(key=lambda v: live.edges[here, v].get("name") or v)
        if len(nxt) > 1:
            pick = nxt[cfg.index(here, here == src_dev, sip, dip, sport, len(nxt))]
        else:
            pick = nxt[0]
        lk = live.edges[here, pick].get("link")
        if lk is not None:
            links.append(int(lk))
        here = pick
    return links


__all__ = ["enforce", "enforce_changed", "walk"]
