"""Exact search over path choices for small planning problems (branch and bound).

Giving each flow one candidate so the busiest link is as light as possible is NP-hard: with
two identical spines it is bin packing. Greedy largest-first plus one-flow moves can stop
above the optimum, e.g. flows of 3, 3, 2, 2, 2 units over two spines of capacity 6: greedy
puts {3, 2, 2} = 7 on one spine and {3, 2} = 5 on the other, and no single move lowers the
7, while {3, 3} / {2, 2, 2} fits in 6. So after the heuristic, when only a few flows are free
to move, a depth-first branch and bound starting from the heuristic's plan either finds a
lighter plan or proves there is none.

Search: flows largest first; at each flow try its candidates in order of the busiest link
they would leave, skipping any that cannot beat the best plan found so far; identical flows
(same candidate set and size) take non-decreasing candidate indices, which removes their
permutations. A node budget and a time budget bound the work; :attr:`ExactResult.complete`
says whether the search finished, i.e. whether the result is proven optimal over the
candidates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.routes import CandidateSet

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
_REL_TOL = 1e-9
_CHECK_EVERY = 256


@dataclass(kw_only=True, slots=True)
class ExactResult:
    complete: bool
    """True when the search finished: no plan over these candidates (with the other flows
    where they are) has a lighter busiest link than the one left in ``choice``."""
    improved: bool
    """True when the search changed ``choice`` (and ``loads``)."""
    nodes: int
    """Search-tree nodes visited."""


class _Stop(Exception):
    pass


def _util(loads: FloatArray, cap: FloatArray, dummy: int) -> FloatArray:
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(loads > 0, loads / cap, 0.0)
    u[dummy] = 0.0
    return u


def branch_and_bound(
    free: IntArray,
    sizes: FloatArray,
    sets: list[CandidateSet],
    set_of: IntArray,
    choice: IntArray,
    loads: FloatArray,
    cap: FloatArray,
    dummy: int,
    *,
    budget_s: float,
    max_nodes: int = 2_000_000,
) -> ExactResult:
    """Re-route the flows in ``free`` (the others stay) to minimize the busiest link's time.

    ``choice`` and ``loads`` (bytes per link, the dummy link last) describe a complete plan
    and are updated in place when a lighter one is found.
    """
    util_now = _util(loads, cap, dummy)
    best = float(util_now.max()) if util_now.size else 0.0
    if len(free) == 0 or best <= 0.0:
        return ExactResult(complete=True, improved=False, nodes=0)
    base = loads.copy()
    for f in free:
        base[sets[set_of[f]].links[choice[f]]] -= sizes[f]
    base[dummy] = 0.0
    np.maximum(base, 0.0, out=base)
    floor = float(_util(base, cap, dummy).max())
    if best <= floor * (1 + _REL_TOL):
        return ExactResult(complete=True, improved=False, nodes=0)

    order = sorted((int(f) for f in free), key=lambda f: (-sizes[f], int(set_of[f]), f))
    local: dict[int, int] = {}
    cand: list[list[list[tuple[int, float]]]] = []
    for f in order:
        rows = []
        for row in sets[set_of[f]].links:
            hops = []
            for lk in row:
                if lk == dummy:
                    continue
                i = local.setdefault(int(lk), len(local))
                hops.append((i, float(sizes[f] / cap[lk])))
            rows.append(hops)
        cand.append(rows)
    util = [0.0] * len(local)
    for lk, i in local.items():
        util[i] = float(base[lk] / cap[lk]) if base[lk] > 0 else 0.0
    n = len(order)
    same_prev = [
        i > 0
        and set_of[order[i]] == set_of[order[i - 1]]
        and sizes[order[i]] == sizes[order[i - 1]]
        for i in range(n)
    ]
    alone = [
        min(max((util[j] + d for j, d in hops), default=0.0) for hops in rows) for rows in cand
    ]
    suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = max(alone[i], suffix[i + 1])

    pick = [0] * n
    best_pick: list[int] | None = None
    deadline = time.perf_counter() + budget_s
    visited = 0

    def dfs(i: int, cur: float, low: int) -> None:
        nonlocal best, best_pick, visited
        visited += 1
        if visited % _CHECK_EVERY == 0 and (visited >= max_nodes or time.perf_counter() > deadline):
            raise _Stop
        if i == n:
            best, best_pick = cur, list(pick)
            return
        limit = best * (1 - _REL_TOL)
        if max(cur, suffix[i]) >= limit:
            return
        options = []
        for c in range(low, len(cand[i])):
            top = cur
            for j, d in cand[i][c]:
                v = util[j] + d
                if v > top:
                    top = v
            if top < limit:
                options.append((top, c))
        options.sort()
        for top, c in options:
            if top >= best * (1 - _REL_TOL):
                break
            hops = cand[i][c]
            for j, d in hops:
                util[j] += d
            pick[i] = c
            nxt_low = c if i + 1 < n and same_prev[i + 1] else 0
            try:
                dfs(i + 1, top, nxt_low)
            finally:
                for j, d in hops:
                    util[j] -= d

    complete = True
    try:
        dfs(0, floor, 0)
    except _Stop:
        complete = False
    if best_pick is None:
        return ExactResult(complete=complete, improved=False, nodes=visited)
    for i, f in enumerate(order):
        choice[f] = best_pick[i]
    for f in order:
        base[sets[set_of[f]].links[choice[f]]] += sizes[f]
    base[dummy] = 0.0
    loads[:] = base
    return ExactResult(complete=complete, improved=True, nodes=visited)


__all__ = ["ExactResult", "branch_and_bound"]
