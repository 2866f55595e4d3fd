from __future__ import annotations

import numpy as np
import pytest

from controller.logic.traffic.compare import (
    SimConfig,
    compare,
    ecmp_paths,
    ideal_phase_times,
    phase_times,
    traffic_of,
    unplanned_traffic,
)
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Planner, PlannerConfig
from controller.logic.traffic.sim import completion_times, max_min_rates

from .conftest import small_fabric

D = 3  # padding link index in the hand-built cases below (links 0..2 are real)


def caps(*c: float) -> np.ndarray:
    return np.asarray([*c, np.inf])


def test_max_min_textbook_case() -> None:
    # link0 cap 1 shared by f0 and f1; link1 cap 2 shared by f1 and f2
    paths = np.asarray([[0, D], [0, 1], [1, D]])
    rates = max_min_rates(paths, caps(1.0, 2.0, 5.0), D)
    assert rates == pytest.approx([0.5, 0.5, 1.5])


def test_max_min_equal_share_and_bottleneck_elsewhere() -> None:
    paths = np.asarray([[0, D], [0, D], [0, 1], [2, D]])
    rates = max_min_rates(paths, caps(3.0, 0.5, 4.0), D)
    # f2 limited to 0.5 by link1; f0, f1 split the rest of link0; f3 alone on link2
    assert rates == pytest.approx([1.25, 1.25, 0.5, 4.0])
    assert rates[:3].sum() == pytest.approx(3.0)


def test_completion_reshares_capacity_when_flows_finish() -> None:
    paths = np.asarray([[0, D], [0, D]])
    fin = completion_times(paths, np.asarray([1.0, 2.0]), caps(2.0, 1.0, 1.0), D)
    # both at rate 1 until t=1, then the second alone at rate 2 for its last byte
    assert fin == pytest.approx([1.0, 1.5])


def test_down_link_never_completes() -> None:
    fin = completion_times(np.asarray([[0, D], [1, D]]), np.ones(2), caps(0.0, 1.0, 1.0), D)
    assert np.isinf(fin[0]) and fin[1] == pytest.approx(1.0)


@pytest.mark.parametrize("oversub", [1.0, 2.0])
def test_no_routing_beats_the_ideal_bound(oversub: float) -> None:
    topo = small_fabric(nodes=32, oversubscription=oversub)
    rng = np.random.default_rng(11)
    nodes = [topo.nodes[i].name for i in rng.permutation(32)]
    job = JobSpec(nodes=nodes, gpus_per_node=2, tp=2, channels=2, grad_bytes=1 << 26)
    planner = Planner(topo)
    plan = planner.plan(job)
    ours = traffic_of(plan)
    base = unplanned_traffic(planner, job)
    for traffic in (ours, base):
        ideal = ideal_phase_times(topo, traffic)["dp"]
        for seed in range(5):
            paths = ecmp_paths(topo, traffic, np.random.default_rng(seed))
            assert phase_times(topo, traffic, paths)["dp"] >= ideal * (1 - 1e-9)
    assert phase_times(topo, ours, plan.paths())["dp"] >= ideal_phase_times(topo, ours)["dp"] * (
        1 - 1e-9
    )


def test_busbw_follows_nccl_tests_conventions_and_plan_beats_ecmp() -> None:
    topo = small_fabric(nodes=16, nics_per_node=8, nodes_per_leaf=4)
    nodes = [topo.nodes[i].name for i in np.random.default_rng(2).permutation(16)]
    job = JobSpec(nodes=nodes, tp=8, grad_bytes=1 << 28, channels=2)
    planner = Planner(topo)
    plan = planner.plan(job)
    rows = {
        r.name: r
        for r in compare(
            plan, unplanned_traffic(planner, job), SimConfig(ecmp_seeds=8, compute_time_s=0.5)
        )
    }
    n = 16
    for r in rows.values():
        assert r.algbw_bytes_per_s == pytest.approx(job.grad_bytes / r.allreduce_s)
        assert r.busbw_bytes_per_s == pytest.approx(r.algbw_bytes_per_s * 2 * (n - 1) / n)
        assert r.step_s == pytest.approx(0.5 + r.allreduce_s)
    nic = 2 * 200e9 / 8  # a dual-port 200G bond
    assert rows["ideal"].busbw_bytes_per_s == pytest.approx(nic)
    assert rows["ours"].busbw_bytes_per_s <= rows["ideal"].busbw_bytes_per_s * (1 + 1e-9)
    assert rows["ours"].busbw_bytes_per_s > rows["ecmp median"].busbw_bytes_per_s
    assert rows["ecmp p95"].allreduce_s >= rows["ecmp median"].allreduce_s
    assert len(rows["ecmp median"].samples_s) == 8


def test_ecmp_draws_follow_candidate_probabilities() -> None:
    topo = small_fabric(nodes=8)
    planner = Planner(topo, PlannerConfig(reorder_ring=False))
    job = JobSpec(nodes=["node-00000", "node-00004"], gpus_per_node=2, tp=2, channels=1)
    traffic = unplanned_traffic(planner, job)
    cs = traffic.sets[traffic.set_of[0]]
    rng = np.random.default_rng(0)
    counts = np.zeros(len(cs))
    draws = 4000
    for _ in range(draws):
        row = ecmp_paths(topo, traffic, rng)[0]
        counts[int(np.flatnonzero((cs.links == row).all(axis=1))[0])] += 1
    assert np.abs(counts / draws - cs.prob).max() < 0.03
