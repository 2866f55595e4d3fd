"""Flow-level simulator: max-min fair sharing, completion times, and a contention-free bound.

Each flow has a fixed path and a size. At any moment the rates are the max-min fair
allocation (progressive filling: raise every unfrozen flow's rate together until some link
is full, freeze the flows crossing it, repeat). When the first flows finish, the rest are
re-shared; a collective completes when its slowest flow does. Packet-level effects
(congestion control, PFC pauses, per-packet latency) are out of scope on purpose: they add
noise, not a different ranking of routing plans.

The ideal bound is what no routing of the same flows could beat, even one that splits
flows perfectly across every path: the largest of (a) each flow alone on its best path,
(b) each NIC's bytes over its bond's capacity, (c) bytes that must leave (or enter) a NIC's
leaves over those leaves' uplink capacity, (d) the same for a pod's core uplinks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.routes import CandidateSet
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_REL = 1e-6


def max_min_rates(paths: IntArray, cap_ext: FloatArray, dummy: int) -> FloatArray:
    """Max-min fair rates (bytes/s) of flows with the given padded paths.

    ``cap_ext`` has one entry per link plus the padding link (``dummy``, +inf). Counts and
    residual capacities are updated incrementally as flows freeze, and flows are found
    through a link → flows index, so each filling level costs O(links), not O(flows).
    """
    n_flows, width = paths.shape
    n_links = cap_ext.shape[0]
    rates = np.full(n_flows, np.inf)
    if n_flows == 0:
        return rates
    flat = paths.ravel()
    counts = np.bincount(flat, minlength=n_links).astype(np.float64)
    counts[dummy] = 0.0
    rem = cap_ext.astype(np.float64).copy()
    order = np.argsort(flat, kind="stable")
    starts = np.searchsorted(flat[order], np.arange(n_links + 1))
    frozen = np.zeros(n_flows, dtype=bool)
    live = np.flatnonzero(counts > 0)
    while live.size:
        share = np.maximum(rem[live], 0.0) / counts[live]
        level = float(share.min())
        tight = live[share <= level * (1 + _REL)]
        entries = np.concatenate([order[starts[lk] : starts[lk + 1]] for lk in tight])
        flows = np.unique(entries // width)
        flows = flows[~frozen[flows]]
        frozen[flows] = True
        rates[flows] = level
        links, dec = np.unique(paths[flows], return_counts=True)
        counts[links] -= dec
        rem[links] -= level * dec
        counts[tight] = 0.0
        counts[dummy] = 0.0
        live = live[counts[live] > 0]
    return rates


def completion_times(
    paths: IntArray, sizes: FloatArray, cap_ext: FloatArray, dummy: int
) -> FloatArray:
    """Finish time (s) of every flow, all starting at 0, re-sharing as flows complete.

    A flow crossing a down link never finishes (+inf).
    """
    n = paths.shape[0]
    # Work on the links these flows use only: far fewer than the fabric has.
    used, inv = np.unique(paths, return_inverse=True)
    paths = inv.reshape(paths.shape).astype(np.int64)
    cap_ext = np.append(cap_ext[used], np.inf)
    hit = np.flatnonzero(used == dummy)
    dummy = int(hit[0]) if hit.size else int(used.size)
    cap_ext[dummy] = np.inf
    finish = np.full(n, np.inf)
    remaining = sizes.astype(np.float64).copy()
    active = np.flatnonzero(remaining > 0)
    finish[remaining <= 0] = 0.0
    now = 0.0
    while active.size:
        rates = max_min_rates(paths[active], cap_ext, dummy)
        with np.errstate(divide="ignore"):
            ttf = np.where(rates > 0, remaining[active] / rates, np.inf)
        step = float(ttf.min())
        if not np.isfinite(step):
            break
        done = ttf <= step * (1 + 1e-7)
        now += step
        remaining[active] -= np.where(np.isfinite(rates), rates, 0.0) * step
        finish[active[done]] = now
        active = active[~done]
    return finish


def ideal_time_s(
    topo: Topology,
    flows_src: tuple[IntArray, IntArray],
    flows_dst: tuple[IntArray, IntArray],
    sizes: FloatArray,
    sets: list[CandidateSet],
    set_of: IntArray,
) -> float:
    """Contention-free lower bound on the time to deliver all these flows (see module doc)."""
    if sizes.size == 0:
        return 0.0
    cap = topo.capacity_ext()
    health = topo.health
    bound = 0.0
    # (a) each flow alone on its best candidate
    best = np.array([float(cap[cs.links].min(axis=1).max()) for cs in sets])
    with np.errstate(divide="ignore"):
        bound = max(bound, float((sizes / best[set_of]).max()))
    # (b) NIC egress / ingress over the bond's live capacity
    sn, sk = flows_src
    dn, dk = flows_dst
    width = max(len(n) for n in topo.ports)
    for (node, nic), egress in (((sn, sk), True), ((dn, dk), False)):
        key = node * width + nic
        uniq, inv = np.unique(key, return_inverse=True)
        tot = np.bincount(inv.reshape(-1), weights=sizes)
        for u, b in zip(uniq, tot, strict=True):
            refs = topo.ports[int(u) // width][int(u) % width]
            c = float(sum(cap[r.up_link if egress else r.down_link] for r in refs))
            bound = max(bound, b / c if c > 0 else np.inf)
    # (c) leaf-set cuts and (d) pod cuts
    pods = topo.pods()

    def live_leaves(node: int, nic: int, egress: bool) -> frozenset[str]:
        return frozenset(
            r.leaf
            for r in topo.ports[node][nic]
            if health[r.up_link if egress else r.down_link] > 0
        )

    up_cap: dict[str, float] = {leaf: 0.0 for leaf in topo.leaves}
    down_cap: dict[str, float] = {leaf: 0.0 for leaf in topo.leaves}
    pod_up: dict[int, float] = {}
    pod_down: dict[int, float] = {}
    pod_of_agg: dict[str, int] = {}
    for leaf in topo.leaves:
        for agg, lk in topo.up[leaf]:
            up_cap[leaf] += cap[lk]
            pod_of_agg[agg] = pods[leaf]
    for kids in topo.down.values():
        for kid, lk in kids:
            if kid in down_cap:
                down_cap[kid] += cap[lk]
    if topo.max_tier >= 3:
        for agg, pod in pod_of_agg.items():
            pod_up[pod] = pod_up.get(pod, 0.0) + sum(cap[lk] for _c, lk in topo.up[agg])
        for sw, kids in topo.down.items():
            if topo.tier[sw] == 3:
                for kid, lk in kids:
                    pod = pod_of_agg.get(kid, -1)
                    pod_down[pod] = pod_down.get(pod, 0.0) + cap[lk]
    leaf_out: dict[frozenset[str], float] = {}
    leaf_in: dict[frozenset[str], float] = {}
    pod_out: dict[int, float] = {}
    pod_in: dict[int, float] = {}
    cache: dict[tuple[int, int, bool], frozenset[str]] = {}
    for i in range(sizes.size):
        a = (int(sn[i]), int(sk[i]), True)
        b = (int(dn[i]), int(dk[i]), False)
        la = cache.get(a) or cache.setdefault(a, live_leaves(*a))
        lb = cache.get(b) or cache.setdefault(b, live_leaves(*b))
        if la.isdisjoint(lb):
            leaf_out[la] = leaf_out.get(la, 0.0) + sizes[i]
            leaf_in[lb] = leaf_in.get(lb, 0.0) + sizes[i]
            if topo.max_tier >= 3:
                pa = {pods[x] for x in la}
                pb = {pods[x] for x in lb}
                if len(pa) == 1 and len(pb) == 1 and pa != pb:
                    pod_out[next(iter(pa))] = pod_out.get(next(iter(pa)), 0.0) + sizes[i]
                    pod_in[next(iter(pb))] = pod_in.get(next(iter(pb)), 0.0) + sizes[i]
    for group, b in leaf_out.items():
        c = sum(up_cap[x] for x in group)
        bound = max(bound, b / c if c > 0 else np.inf)
    for group, b in leaf_in.items():
        c = sum(down_cap[x] for x in group)
        bound = max(bound, b / c if c > 0 else np.inf)
    for pod, b in pod_out.items():
        c = pod_up.get(pod, 0.0)
        bound = max(bound, b / c if c > 0 else np.inf)
    for pod, b in pod_in.items():
        c = pod_down.get(pod, 0.0)
        bound = max(bound, b / c if c > 0 else np.inf)
    return bound


__all__ = ["completion_times", "ideal_time_s", "max_min_rates"]
