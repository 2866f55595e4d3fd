"""The planner keeps every link within capacity whenever some plan does (small problems).

"Within capacity for a horizon T" means every link's bytes fit in T at its capacity, i.e. the
plan's busiest-link time is at most T. A brute-force search over every combination of
candidate paths finds the smallest T any plan meets; the planner must meet it too.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Plan, Planner, PlannerConfig
from controller.logic.traffic.topofile import topology_from_dict
from controller.logic.traffic.topology import Topology
from tests.traffic.plan_checks import brute_force_optimum, flows_by_index

GBPS = 1e9 / 8
MAX_COMBOS = 20_000


def loads_of(plan: Plan) -> np.ndarray:
    loads = np.zeros(plan.topology.n_links + 1)
    for f, row in enumerate(plan.paths()):
        loads[row] += plan.flows.size_bytes[f]
    loads[-1] = 0.0
    return loads


def two_spines(hosts: int) -> Topology:
    return topology_from_dict(
        {
            "name": "bin-packing",
            "port_speed_gbps": 100,
            "switches": [{"name": n, "tier": 1} for n in "AB"]
            + [{"name": f"s{j}", "tier": 2} for j in range(2)],
            "cables": [{"lower": leaf, "upper": f"s{j}"} for leaf in "AB" for j in range(2)],
            "nodes": [
                {"name": f"{leaf.lower()}{i}", "nics": [{"ports": [{"leaf": leaf}]}]}
                for leaf in "AB"
                for i in range(hosts)
            ],
        }
    )


def test_bin_packing_counterexample_to_greedy_plus_local_search() -> None:
    # Five flows A->B of 3, 3, 2, 2, 2 units over two spines whose uplinks carry 6 units in
    # 1 s. {3,3} / {2,2,2} fits in 1 s; largest-first gives {3,2,2} / {3,2} (7/6 s) and no
    # single-flow move lowers the 7, so the heuristic alone overruns the capacity.
    topo = two_spines(hosts=5)
    unit = 100 * GBPS / 6
    idx = topo.node_index
    pairs = [(idx[f"a{i}"], idx[f"b{i}"]) for i in range(5)]
    flows = flows_by_index(pairs, [3 * unit, 3 * unit, 2 * unit, 2 * unit, 2 * unit])
    job = JobSpec(nodes=["a0"])
    heuristic = Planner(topo, PlannerConfig(exact_max_flows=0)).plan_flows(flows, job)
    assert heuristic.max_link_time_s() == pytest.approx(7 / 6)
    assert not heuristic.proven_optimal
    plan = Planner(topo).plan_flows(flows, job)
    assert plan.max_link_time_s() <= 1.0 + 1e-9
    assert plan.proven_optimal
    assert np.allclose(plan.loads_bytes, loads_of(plan))


@st.composite
def problems(draw: Any) -> tuple[dict[str, Any], list[tuple[int, int]], list[int]]:
    n_leaves = draw(st.integers(2, 3))
    n_spines = draw(st.integers(2, 3))
    cables = []
    for li in range(n_leaves):
        for j in range(n_spines):
            # spine 0 reaches every leaf, so the fabric is connected; others may be missing
            cap = draw(st.sampled_from([100, 100, 200] if j == 0 else [0, 100, 100, 200]))
            if cap:
                cables.append({"lower": f"L{li}", "upper": f"S{j}", "capacity_gbps": cap})
    n_nodes = draw(st.integers(2, 6))
    nodes = []
    node_leaves: list[set[int]] = []
    for i in range(n_nodes):
        leaves = draw(st.lists(st.integers(0, n_leaves - 1), min_size=1, max_size=2, unique=True))
        node_leaves.append(set(leaves))
        ports = [{"leaf": f"L{x}", "capacity_gbps": 400} for x in leaves]
        nodes.append({"name": f"n{i}", "nics": [{"ports": ports}]})
    n_flows = draw(st.integers(3, 8))
    # mostly flows between different leaves, so they contend for the spines
    apart = [
        [d for d in range(n_nodes) if not node_leaves[d] & node_leaves[src]]
        for src in range(n_nodes)
    ]
    pairs = []
    for _ in range(n_flows):
        src = draw(st.integers(0, n_nodes - 1))
        others = apart[src] if apart[src] and draw(st.integers(0, 3)) else None
        if others is None:
            others = [d for d in range(n_nodes) if d != src]
        pairs.append((src, draw(st.sampled_from(others))))
    sizes = draw(st.lists(st.integers(2, 6), min_size=n_flows, max_size=n_flows))
    doc = {
        "name": "random",
        "port_speed_gbps": 100,
        "switches": [{"name": f"L{i}", "tier": 1} for i in range(n_leaves)]
        + [{"name": f"S{j}", "tier": 2} for j in range(n_spines)],
        "cables": cables,
        "nodes": nodes,
    }
    return doc, pairs, sizes


BIN_PACKING = (
    {
        "name": "bin-packing",
        "port_speed_gbps": 100,
        "switches": [
            {"name": "L0", "tier": 1},
            {"name": "L1", "tier": 1},
            {"name": "S0", "tier": 2},
            {"name": "S1", "tier": 2},
        ],
        "cables": [{"lower": f"L{i}", "upper": f"S{j}"} for i in range(2) for j in range(2)],
        "nodes": [
            {"name": f"n{i}", "nics": [{"ports": [{"leaf": f"L{i // 5}", "capacity_gbps": 400}]}]}
            for i in range(10)
        ],
    },
    [(i, i + 5) for i in range(5)],
    [3, 3, 2, 2, 2],
)


# Without the exact search about 2% of these problems overrun (greedy + local search stops
# above the optimum); 300 examples find one with probability > 99.9%, and the bin-packing
# instance is always tried.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@example(BIN_PACKING)
def test_plan_within_capacity_whenever_brute_force_finds_one(
    problem: tuple[dict[str, Any], list[tuple[int, int]], list[int]],
) -> None:
    doc, pairs, units = problem
    topo = topology_from_dict(doc)
    flows = flows_by_index(pairs, [u * 1e9 for u in units])
    plan = Planner(topo).plan_flows(flows, JobSpec(nodes=["n0"]))
    combos = int(np.prod([len(plan.sets[s]) for s in plan.set_of]))
    assume(combos <= MAX_COMBOS)
    # the tightest horizon within which some plan keeps every link within capacity
    horizon_s = brute_force_optimum(plan)
    assert plan.max_link_time_s() <= horizon_s * (1 + 1e-9)
    assert plan.proven_optimal
    assert np.allclose(plan.loads_bytes, loads_of(plan))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=4, max_size=8), st.integers(0, 7))
@example([7, 8, 5, 2, 5, 6], 0)  # greedy alone: 2.0 s where 1.84 s fits
def test_replan_keeps_moved_flows_within_capacity(sizes: list[int], down: int) -> None:
    # Re-planning keeps unaffected flows where they are, so its optimum is over the moved
    # flows' candidates only: compare with brute force over exactly those.
    topo = two_spines(hosts=8)
    idx = topo.node_index
    pairs = [(idx[f"a{i}"], idx[f"b{i}"]) for i in range(len(sizes))]
    planner = Planner(topo)
    plan = planner.plan_flows(
        flows_by_index(pairs, [x * 1e9 for x in sizes]), JobSpec(nodes=["a0"])
    )
    spine = f"s{down % 2}"
    new = planner.replan(plan, [(f"A--{spine}", 0.5)])
    cap = topo.capacity_ext()
    paths = plan.paths()
    link = topo.link_index[f"A->{spine}"]
    affected = [f for f in range(len(sizes)) if (paths[f] == link).any()]
    fixed = np.zeros(topo.n_links + 1)
    for f in range(len(sizes)):
        if f not in affected:
            fixed[paths[f]] += sizes[f] * 1e9
    best = np.inf
    for assign in itertools.product(*(range(len(new.sets[new.set_of[f]])) for f in affected)):
        loads = fixed.copy()
        for f, c in zip(affected, assign, strict=True):
            loads[new.sets[new.set_of[f]].links[c]] += sizes[f] * 1e9
        loads[-1] = 0.0
        best = min(best, float((loads[:-1] / cap[:-1]).max()))
    assert new.max_link_time_s() <= best * (1 + 1e-9)
    unaffected = [f for f in range(len(sizes)) if f not in affected]
    assert (new.paths()[unaffected] == paths[unaffected]).all()


def test_enforcement_keeps_the_proof_only_when_no_flow_moved() -> None:
    from controller.logic.traffic.enforce import enforce
    from controller.logic.traffic.hashing import HashConfig

    topo = two_spines(hosts=5)
    unit = 100 * GBPS / 6
    idx = topo.node_index
    pairs = [(idx[f"a{i}"], idx[f"b{i}"]) for i in range(5)]
    flows = flows_by_index(pairs, [3 * unit, 3 * unit, 2 * unit, 2 * unit, 2 * unit])
    plan = Planner(topo).plan_flows(flows, JobSpec(nodes=["a0"]))
    assert plan.proven_optimal
    for function in ("crc32", "crc16-ccitt", "xor16"):
        enforced, _ports = enforce(plan, HashConfig(function=function))
        assert enforced.proven_optimal == (enforced.hash_moved_flows == 0)
        assert enforced.max_link_time_s() >= plan.max_link_time_s() * (1 - 1e-9)
