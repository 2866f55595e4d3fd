"""The planning problem as a linear program, to measure the greedy planner against.

    minimize t  subject to  sum_c x[k,c] = 1                        for every commodity k
                            sum_{k,c: l in c} size_k x[k,c] <= t cap_l   for every link l
                            x >= 0

Commodities are flows with the same candidate set (the QPs and channels of one NIC pair),
so splitting is allowed; the optimum ``t`` is therefore a lower bound on the busiest
link's time for any integral plan over the same candidates. Rounding (each commodity's
flows go to its candidates in proportion to ``x``, largest share first) gives an integral
plan to compare with greedy + local search. Solved with HiGHS through scipy, an optional
dependency: the planner itself never needs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from controller.logic.traffic.errors import PlanError
from controller.logic.traffic.planner import Plan


@dataclass(kw_only=True, slots=True)
class LpResult:
    bound_s: float
    """LP optimum: no plan over these candidates has a lighter busiest link."""
    rounded_max_link_time_s: float
    """Busiest link of the rounded (integral) LP plan."""
    solve_time_s: float
    variables: int
    status: str


def solve_lp(plan: Plan, *, time_limit_s: float = 120.0) -> LpResult:
    try:
        from scipy.optimize import linprog  # type: ignore[import-untyped]
        from scipy.sparse import coo_matrix  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PlanError("the LP comparison needs scipy (pip install scipy)") from exc
    topo = plan.topology
    cap = topo.capacity_ext()
    dummy = topo.dummy_link
    sizes = plan.flows.size_bytes
    commodities = np.unique(plan.set_of)
    demand = np.bincount(plan.set_of, weights=sizes, minlength=len(plan.sets))
    var_k: list[int] = []
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    n_var = 0
    offsets = {}
    for k in commodities:
        links = plan.sets[k].links
        offsets[int(k)] = n_var
        for c in range(links.shape[0]):
            real = links[c][links[c] != dummy]
            rows.append(real)
            cols.append(np.full(real.shape[0], n_var))
            vals.append(np.full(real.shape[0], demand[k] / 1e9))  # GB keeps HiGHS well scaled
            var_k.append(int(k))
            n_var += 1
    r = np.concatenate(rows)
    used, link_row = np.unique(r, return_inverse=True)
    t_col = n_var
    a_ub = coo_matrix(
        (
            np.concatenate([*vals, -cap[used] / 1e9]),
            (
                np.concatenate([link_row, np.arange(used.shape[0])]),
                np.concatenate([*cols, np.full(used.shape[0], t_col)]),
            ),
        ),
        shape=(used.shape[0], n_var + 1),
    ).tocsr()
    k_index = {int(k): i for i, k in enumerate(commodities)}
    a_eq = coo_matrix(
        (np.ones(n_var), (np.asarray([k_index[k] for k in var_k]), np.arange(n_var))),
        shape=(len(commodities), n_var + 1),
    ).tocsr()
    cost = np.zeros(n_var + 1)
    cost[t_col] = 1.0
    t0 = time.perf_counter()
    res = linprog(
        cost,
        A_ub=a_ub,
        b_ub=np.zeros(used.shape[0]),
        A_eq=a_eq,
        b_eq=np.ones(len(commodities)),
        bounds=(0, None),
        method="highs",
        options={"time_limit": time_limit_s},
    )
    solve = time.perf_counter() - t0
    if res.x is None:
        return LpResult(
            bound_s=float("nan"),
            rounded_max_link_time_s=float("nan"),
            solve_time_s=solve,
            variables=n_var,
            status=str(res.message),
        )
    x = res.x
    loads = np.zeros(topo.n_links + 1)
    for kk in commodities:
        k = int(kk)
        flows = np.flatnonzero(plan.set_of == k)
        share = x[offsets[k] : offsets[k] + len(plan.sets[k])]
        want = share * len(flows)
        counts = np.floor(want).astype(int)
        for extra in np.argsort(-(want - counts))[: len(flows) - counts.sum()]:
            counts[extra] += 1
        picks = np.repeat(np.arange(len(share)), counts)
        for f, pick in zip(flows, picks, strict=True):
            loads[plan.sets[k].links[pick]] += sizes[f]
    loads[dummy] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        util = np.where(loads > 0, loads / cap, 0.0)
    return LpResult(
        bound_s=float(res.x[t_col]),
        rounded_max_link_time_s=float(util[:-1].max()),
        solve_time_s=solve,
        variables=n_var,
        status=str(res.message),
    )


__all__ = ["LpResult", "solve_lp"]
