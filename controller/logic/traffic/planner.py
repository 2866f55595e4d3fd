"""Path and bond-port assignment that keeps the busiest link as light as possible.

Every flow between NICs picks one candidate (a bond port at each end and a spine path, see
:mod:`.routes`). The cost of a link is the time it needs for the bytes routed over it,
``load / capacity``; the plan minimizes the largest such time, which bounds how long the
collective takes. Three stages:

1. greedy, largest flow first: each flow takes the candidate whose busiest link would be
   least busy afterwards (ties go to the candidate with the lighter total, which prefers
   short intra-leaf paths and spreads bond ports evenly);
2. local search: take the busiest link, move one of its flows to a candidate whose busiest
   link stays strictly below it, repeat until no flow on the busiest link can move or the
   time budget is spent;
3. exact search (:mod:`.exact`) when few flows are free to move: branch and bound from the
   heuristic's plan, which finds the optimum or proves the plan optimal within its budget.
   The heuristic alone can stop above the optimum (the problem contains bin packing).

Re-planning after a link goes down or slow touches only the flows routed over that link:
they are lifted off and put back greedily with the new capacities (then exactly, when they
are few). A link going down or coming back also changes equal-cost groups that other flows'
hash decisions go through; those flows keep their paths but are pointed at their NIC pair's
fresh candidate set and listed in ``Plan.reported`` so they get new source ports. Plans
are immutable values carrying an id (shared by every version of one job's plan) and a
version number.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import PlanError
from controller.logic.traffic.exact import branch_and_bound
from controller.logic.traffic.jobs import Flows, JobSpec, build_flows, topology_node_order
from controller.logic.traffic.routes import CandidateSet, RouteTable
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
_ACCEPT_TRIES = 8


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    reorder_ring: bool = True
    """Reorder node ranks so ring neighbours share a leaf (needs no switch support)."""
    local_search_budget_s: float = 2.0
    """Wall-clock budget for local search after the greedy pass, seconds."""
    local_search_max_moves: int = 200_000
    """Upper bound on local-search moves, so tiny budgets and huge jobs both terminate."""
    tie_weight: float = 1e-3
    """Weight of the summed link time in the score; small so it only breaks ties."""
    exact_max_flows: int = 32
    """Run the exact search after local search when at most this many flows are free to
    move (all flows when planning, the affected ones when re-planning). Branch and bound is
    exponential in the worst case, so larger problems keep the heuristic's plan."""
    exact_budget_s: float = 0.5
    """Wall-clock budget of the exact search when planning, seconds; when it runs out the
    best plan found so far is kept and ``Plan.proven_optimal`` stays False."""
    replan_exact_budget_s: float = 0.02
    """Budget of the exact search when re-planning, seconds: kept small because re-planning
    after a failure has to be fast (target < 200 ms)."""


@dataclass(kw_only=True, slots=True)
class Plan:
    """One version of a job's traffic plan. ``choice[i]`` indexes ``sets[set_of[i]]``."""

    plan_id: str
    version: int
    parent_version: int | None
    created_unix_s: float
    topology: Topology
    job: JobSpec
    node_order: list[str]
    flows: Flows
    sets: list[CandidateSet]
    set_of: IntArray
    choice: IntArray
    loads_bytes: FloatArray
    plan_time_s: float
    moved_flows: int = 0
    hash_moved_flows: int = 0
    """Flows moved off their planned path because the modelled hash cannot reach it."""
    reported_flows: int = 0
    """Flows a re-plan left on their path whose hash decisions changed (an equal-cost group
    on the way grew or shrank), so they need a new source port (:attr:`reported`)."""
    reported: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Indices of those flows in this version; ``enforce_changed`` re-chooses their ports."""
    changes: list[dict[str, object]] = field(default_factory=list)
    path_matrix: IntArray | None = None
    """Cache of :meth:`paths`; pass None whenever ``choice`` or ``sets`` change."""
    proven_optimal: bool = False
    """True when the exact search finished: no plan over the same candidates has a lighter
    busiest link. Re-planned versions only say so for the moved flows, so they set False."""

    def paths(self) -> IntArray:
        """Link matrix of the chosen candidates, one row per flow (padded)."""
        if self.path_matrix is None:
            self.path_matrix = chosen_rows(self.sets, self.set_of, self.choice)
        return self.path_matrix

    def link_times_s(self) -> FloatArray:
        cap = self.topology.capacity_ext()
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(self.loads_bytes > 0, self.loads_bytes / cap, 0.0)
        return t[:-1]

    def max_link_time_s(self) -> float:
        t = self.link_times_s()
        return float(t.max()) if t.size else 0.0

    def bond_imbalance(self) -> float:
        """Mean over bonded NICs of |bytes on busiest port - bytes on idlest| / total bytes."""
        topo = self.topology
        vals = []
        for node in topo.ports:
            for refs in node:
                if len(refs) < 2:
                    continue
                tx = [self.loads_bytes[r.up_link] for r in refs]
                if sum(tx) > 0:
                    vals.append((max(tx) - min(tx)) / sum(tx))
        return float(np.mean(vals)) if vals else 0.0

    def stats(self) -> dict[str, object]:
        t = self.link_times_s()
        # No load anywhere (a job on one node, zero bytes): argmax would name link 0 as the
        # busiest, and the API and CLI would show an idle link as the bottleneck.
        worst = int(np.argmax(t)) if t.size and t.max() > 0 else -1
        paths = self.paths()
        n_real = (paths != self.topology.dummy_link).sum(axis=1) if len(paths) else paths
        return {
            "flows": len(self.flows),
            "flows_via_spine": int((n_real > 2).sum()) if len(paths) else 0,
            "max_link_time_s": float(t.max()) if t.size else 0.0,
            "busiest_link": self.topology.link_names[worst] if worst >= 0 else None,
            "bond_imbalance": self.bond_imbalance(),
            "plan_time_s": self.plan_time_s,
            "moved_flows": self.moved_flows,
            "hash_moved_flows": self.hash_moved_flows,
            "reported_flows": self.reported_flows,
            # True only when the exact search proved no plan has a lower busiest-link time.
            "proven_optimal": self.proven_optimal,
        }


def chosen_rows(
    sets: list[CandidateSet], set_of: IntArray, choice: IntArray, flows: IntArray | None = None
) -> IntArray:
    """Rows of the chosen candidates for ``flows`` (all flows when None)."""
    idx = range(len(choice)) if flows is None else flows
    rows = [sets[set_of[f]].links[choice[f]] for f in idx]
    if not rows:
        return np.zeros((0, sets[0].links.shape[1] if sets else 1), dtype=np.int64)
    return np.stack(rows)


class Planner:
    """Plans jobs on one (live) topology; link health changes go through :meth:`replan`."""

    def __init__(self, topo: Topology, config: PlannerConfig | None = None) -> None:
        self.topo = topo
        self.config = config or PlannerConfig()
        self.routes = RouteTable(topo)
        self._nic_of_link: dict[int, set[tuple[int, int]]] | None = None
        self._leaf_bits: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ building blocks

    def candidate_sets(self, flows: Flows) -> tuple[list[CandidateSet], IntArray]:
        if len(flows) == 0:
            return [], np.zeros(0, dtype=np.int64)
        keys = np.stack([flows.src_node, flows.src_nic, flows.dst_node, flows.dst_nic], axis=1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        sets: list[CandidateSet] = []
        for row in uniq:
            sn, sk, dn, dk = (int(x) for x in row)
            cs = self.routes.candidates(sn, sk, dn, dk)
            if cs is None:
                src = f"{self.topo.nodes[sn].name}/nic{sk}"
                dst = f"{self.topo.nodes[dn].name}/nic{dk}"
                raise PlanError(f"no live path from {src} to {dst}: the fabric is partitioned")
            sets.append(cs)
        return sets, inverse.reshape(-1).astype(np.int64)

    def _greedy(
        self,
        order: IntArray,
        sizes: FloatArray,
        sets: list[CandidateSet],
        set_of: IntArray,
        choice: IntArray,
        loads: FloatArray,
        penalty: list[FloatArray] | None = None,
    ) -> None:
        cap = self.topo.capacity_ext()
        tie = self.config.tie_weight
        for f in order:
            cs = sets[set_of[f]]
            links = cs.links
            size = sizes[f]
            with np.errstate(divide="ignore", invalid="ignore"):
                u = (loads[links] + size) / cap[links]
            u[np.isnan(u)] = 0.0
            score = u.max(axis=1) + tie * u.sum(axis=1)
            if penalty is not None:
                score = score + penalty[set_of[f]]
            c = int(np.argmin(score))
            if not np.isfinite(score[c]):
                raise PlanError(f"flow {int(f)} has no candidate path with capacity left")
            choice[f] = c
            loads[links[c]] += size
        loads[-1] = 0.0

    def _exact(
        self,
        free: IntArray,
        sizes: FloatArray,
        sets: list[CandidateSet],
        set_of: IntArray,
        choice: IntArray,
        loads: FloatArray,
        *,
        budget_s: float,
    ) -> bool:
        """Branch and bound over ``free`` from the heuristic's choice, when few enough flows
        can move for it to finish; True when it proved the result optimal."""
        if not 0 < len(free) <= self.config.exact_max_flows:
            return False
        result = branch_and_bound(
            free, sizes, sets, set_of, choice, loads,
            self.topo.capacity_ext(), self.topo.dummy_link, budget_s=budget_s,
        )  # fmt: skip
        return bool(result.complete)

    def _local_search(
        self,
        sizes: FloatArray,
        sets: list[CandidateSet],
        set_of: IntArray,
        choice: IntArray,
        loads: FloatArray,
        *,
        accept: Callable[[int, int], bool] | None = None,
        budget_s: float | None = None,
        penalty: list[FloatArray] | None = None,
    ) -> int:
        """Hill-climb on the busiest link; ``accept(flow, candidate)`` may veto a move
        (enforcement uses it to allow only paths the hash can reach)."""
        cfg = self.config
        budget = cfg.local_search_budget_s if budget_s is None else budget_s
        if budget <= 0 or len(sizes) == 0:
            return 0
        deadline = time.perf_counter() + budget
        cap = self.topo.capacity_ext()
        dummy = self.topo.dummy_link
        members: list[set[int]] = [set() for _ in range(len(cap))]
        for f in range(len(sizes)):
            for lk in sets[set_of[f]].links[choice[f]]:
                members[lk].add(f)
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(loads > 0, loads / cap, 0.0)
        util[dummy] = 0.0
        moves = 0
        while moves < cfg.local_search_max_moves and time.perf_counter() < deadline:
            worst = int(np.argmax(util))
            top = util[worst]
            if top <= 0:
                break
            moved = False
            for f in sorted(members[worst], key=lambda i: -sizes[i]):
                cs = sets[set_of[f]]
                cur = int(choice[f])
                size = sizes[f]
                links = cs.links
                loads[links[cur]] -= size
                with np.errstate(divide="ignore", invalid="ignore"):
                    u = (loads[links] + size) / cap[links]
                u[np.isnan(u)] = 0.0
                mx = u.max(axis=1)
                score = mx + cfg.tie_weight * u.sum(axis=1)
                if penalty is not None:
                    score = score + penalty[set_of[f]]
                    mx = mx + penalty[set_of[f]]
                c = int(np.argmin(score))
                if accept is not None:
                    better = [int(x) for x in np.argsort(score, kind="stable")[:_ACCEPT_TRIES]]
                    better = [x for x in better if x != cur and mx[x] < top * (1 - 1e-9)]
                    c = next((x for x in better if accept(f, x)), cur)
                if c != cur and mx[c] < top * (1 - 1e-9):
                    loads[links[c]] += size
                    for lk in links[cur]:
                        members[lk].discard(f)
                    for lk in links[c]:
                        members[lk].add(f)
                    choice[f] = c
                    touched = np.concatenate([links[cur], links[c]])
                    loads[dummy] = 0.0
                    with np.errstate(divide="ignore", invalid="ignore"):
                        util[touched] = np.where(
                            loads[touched] > 0, loads[touched] / cap[touched], 0
                        )
                    util[dummy] = 0.0
                    moves += 1
                    moved = True
                    break
                loads[links[cur]] += size
            loads[dummy] = 0.0
            if not moved:
                break
        return moves

    # ------------------------------------------------------------------ public

    def plan(self, job: JobSpec, *, plan_id: str | None = None) -> Plan:
        """Plan a job: ring order, flows, candidates, greedy, local search."""
        t0 = time.perf_counter()
        job.validate(self.topo)
        order = (
            topology_node_order(self.topo, job.nodes)
            if self.config.reorder_ring
            else list(job.nodes)
        )
        placed = dataclasses.replace(job, nodes=order)
        return self.plan_flows(build_flows(placed, self.topo), placed, plan_id=plan_id, t0=t0)

    def plan_flows(
        self, flows: Flows, job: JobSpec, *, plan_id: str | None = None, t0: float | None = None
    ) -> Plan:
        """Route given flows (``job`` only labels the plan); :meth:`plan` builds them."""
        t0 = time.perf_counter() if t0 is None else t0
        sets, set_of = self.candidate_sets(flows)
        choice = np.zeros(len(flows), dtype=np.int64)
        loads = np.zeros(self.topo.n_links + 1, dtype=np.float64)
        sizes = flows.size_bytes
        self._greedy(np.argsort(-sizes, kind="stable"), sizes, sets, set_of, choice, loads)
        self._local_search(sizes, sets, set_of, choice, loads)
        proven = self._exact(
            np.arange(len(flows), dtype=np.int64), sizes, sets, set_of, choice, loads,
            budget_s=self.config.exact_budget_s,
        )  # fmt: skip
        self.routes.release_stale()
        return Plan(
            plan_id=plan_id or uuid.uuid4().hex[:12],
            version=1,
            parent_version=None,
            created_unix_s=time.time(),
            topology=self.topo,
            job=job,
            node_order=list(job.nodes),
            flows=flows,
            sets=sets,
            set_of=set_of,
            choice=choice,
            loads_bytes=loads,
            plan_time_s=time.perf_counter() - t0,
            path_matrix=chosen_rows(sets, set_of, choice),
            proven_optimal=proven,
        )

    def _under(self, changed: list[int]) -> tuple[int, set[tuple[int, int]]]:
        """Leaves (bitmask) and NICs below the changed links. A minimal up-down path uses a
        link going up only from a source leaf under its lower end, and going down only to a
        destination leaf under it, so only NIC pairs with a leaf (or a NIC) here can gain or
        lose candidates, i.e. see an equal-cost group on their way change."""
        topo = self.topo
        mask = 0
        nics: set[tuple[int, int]] = set()
        for lk in set(changed):
            a, b = topo.link_src[lk], topo.link_dst[lk]
            if a not in topo.tier or b not in topo.tier:  # a NIC port's link
                nics |= self._nic_links().get(lk, set())
                continue
            lo = a if topo.tier[a] < topo.tier[b] else b
            stack, seen = [lo], {lo}
            while stack:
                sw = stack.pop()
                mask |= topo.leaf_bit.get(sw, 0)
                for kid, _ in topo.down.get(sw, ()):
                    if kid not in seen:
                        seen.add(kid)
                        stack.append(kid)
        return mask, nics

    def _nic_links(self) -> dict[int, set[tuple[int, int]]]:
        if self._nic_of_link is None:
            self._nic_of_link = {}
            for refs in (r for node in self.topo.ports for r in node):
                for r in refs:
                    for lk in (r.up_link, r.down_link):
                        self._nic_of_link.setdefault(lk, set()).add((r.node, r.nic))
        return self._nic_of_link

    def _nic_leaves(self, node: int, nic: int) -> int:
        key = (node, nic)
        bits = self._leaf_bits.get(key)
        if bits is None:
            bits = 0
            for r in self.topo.ports[node][nic]:
                bits |= self.topo.leaf_bit[r.leaf]
            self._leaf_bits[key] = bits
        return bits

    def _refresh_decisions(
        self,
        plan: Plan,
        changed: list[int],
        kept: IntArray,
        sets: list[CandidateSet],
        set_of: IntArray,
        choice: IntArray,
        fresh: dict[tuple[int, int, int, int], int],
    ) -> tuple[IntArray, IntArray]:
        """Point the ``kept`` flows (not on a changed link) at their NIC pair's candidate set
        on the current fabric, where it differs from the one they were planned on, keeping
        each flow's path. Returns the flows whose hash decisions changed (they need a new
        source port) and those whose path is no longer a candidate (a link that came back
        made a shorter one; they are re-placed like the flows on the link)."""
        reported: list[int] = []
        lost: list[int] = []
        mask, nics = self._under(changed)
        if len(kept) and (mask or nics):
            fl = plan.flows
            paths = plan.paths()
            old_of = plan.set_of[kept]
            order = np.argsort(old_of, kind="stable")
            grouped = kept[order]
            firsts, starts = np.unique(old_of[order], return_index=True)
            bounds = [*starts[1:].tolist(), len(grouped)]
            for s, lo, hi in zip(firsts.tolist(), starts.tolist(), bounds, strict=True):
                members = grouped[lo:hi]
                f0 = int(members[0])
                key = (int(fl.src_node[f0]), int(fl.src_nic[f0]),
                       int(fl.dst_node[f0]), int(fl.dst_nic[f0]))  # fmt: skip
                if (
                    key[:2] not in nics
                    and key[2:] not in nics
                    and not (self._nic_leaves(*key[:2]) | self._nic_leaves(*key[2:])) & mask
                ):
                    continue
                old = plan.sets[s]
                cs = self.routes.candidates(*key)
                if cs is None:  # cannot happen for a live path; re-place and let it raise
                    lost += [int(f) for f in members]
                    continue
                if cs.choices == old.choices and np.array_equal(cs.links, old.links):
                    continue
                if key not in fresh:
                    fresh[key] = len(sets)
                    sets.append(cs)
                row_of = {row.tobytes(): r for r, row in enumerate(cs.links)}
                for f in members.tolist():
                    r = row_of.get(paths[f].tobytes())
                    if r is None:
                        lost.append(f)
                        continue
                    if cs.choices[r] != old.choices[plan.choice[f]]:
                        reported.append(f)
                    set_of[f] = fresh[key]
                    choice[f] = r
        return np.asarray(sorted(reported), dtype=np.int64), np.asarray(lost, dtype=np.int64)

    def replan(self, plan: Plan, changes: list[tuple[str, float]]) -> Plan:
        """Apply link health changes (``("a--b", 0.0)`` down, ``0.25`` slow, ``1.0`` healed)
        and move only the flows routed over a changed link. Flows whose hash decisions
        changed with the fabric keep their paths and are listed in ``reported`` (see
        :meth:`_refresh_decisions`). Returns the next version."""
        t0 = time.perf_counter()
        changed: list[int] = []
        records: list[dict[str, object]] = []
        for spec, factor in changes:
            links = self.topo.resolve_link(spec)
            self.topo.set_health(links, factor)
            changed += links
            records.append({"link": spec, "health": factor})
        paths = plan.paths()
        crossing = np.isin(paths, np.asarray(changed, dtype=np.int64)).any(axis=1)
        sets = list(plan.sets)
        set_of = plan.set_of.copy()
        choice = plan.choice.copy()
        loads = plan.loads_bytes.copy()
        sizes = plan.flows.size_bytes
        fl = plan.flows
        fresh: dict[tuple[int, int, int, int], int] = {}
        reported, lost = self._refresh_decisions(
            plan, changed, np.flatnonzero(~crossing), sets, set_of, choice, fresh
        )
        affected = np.union1d(np.flatnonzero(crossing), lost).astype(np.int64)
        for f in affected:
            loads[paths[f]] -= sizes[f]
            key = (int(fl.src_node[f]), int(fl.src_nic[f]), int(fl.dst_node[f]), int(fl.dst_nic[f]))
            if key not in fresh:
                cs = self.routes.candidates(*key)
                if cs is None:
                    src = f"{self.topo.nodes[key[0]].name}/nic{key[1]}"
                    dst = f"{self.topo.nodes[key[2]].name}/nic{key[3]}"
                    raise PlanError(f"no live path from {src} to {dst} after the link change")
                fresh[key] = len(sets)
                sets.append(cs)
            set_of[f] = fresh[key]
        loads[-1] = 0.0
        np.maximum(loads, 0.0, out=loads)
        order = affected[np.argsort(-sizes[affected], kind="stable")]
        self._greedy(order, sizes, sets, set_of, choice, loads)
        self._exact(
            affected.astype(np.int64), sizes, sets, set_of, choice, loads,
            budget_s=self.config.replan_exact_budget_s,
        )  # fmt: skip
        before = paths[affected]
        after = chosen_rows(sets, set_of, choice, affected) if len(affected) else before
        moved = int((before != after).any(axis=1).sum()) if len(affected) else 0
        new_paths = paths.copy()
        new_paths[affected] = after
        return dataclasses.replace(
            plan,
            version=plan.version + 1,
            parent_version=plan.version,
            created_unix_s=time.time(),
            sets=sets,
            set_of=set_of,
            choice=choice,
            loads_bytes=loads,
            plan_time_s=time.perf_counter() - t0,
            moved_flows=moved,
            reported_flows=len(reported),
            reported=reported,
            changes=plan.changes + records,
            path_matrix=new_paths,
            proven_optimal=False,
        )


__all__ = ["Plan", "Planner", "PlannerConfig"]
