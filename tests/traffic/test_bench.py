"""bench.traffic on tiny jobs: the JSON keys the issue fixed stay, the re-plan fails the
most loaded spine cable, and plan+enforce time is reported on its own."""

from __future__ import annotations

import json

import numpy as np
import pytest

import bench.traffic as bt
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Planner, PlannerConfig

from .conftest import small_fabric


def test_most_loaded_spine_cable_is_the_busiest_fabric_link() -> None:
    topo = small_fabric(nodes=16)
    nodes = [topo.nodes[i].name for i in np.random.default_rng(3).permutation(16)]
    job = JobSpec(nodes=nodes, gpus_per_node=2, tp=2, channels=2, grad_bytes=1 << 26)
    plan = Planner(topo, PlannerConfig(reorder_ring=False)).plan(job)
    cable = bt.most_loaded_spine_cable(plan)
    links = topo.resolve_link(cable)
    fabric = [
        i
        for i in range(topo.n_links)
        if topo.link_src[i] in topo.tier and topo.link_dst[i] in topo.tier
    ]
    times = plan.link_times_s()
    assert max(times[links]) == pytest.approx(max(times[fabric]))
    assert all(topo.link_src[i] in topo.tier and topo.link_dst[i] in topo.tier for i in links)


@pytest.mark.slow
def test_bench_quick_json_keys(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bt, "SIZES", (256, 512))
    monkeypatch.setattr(bt, "SWEEP_GPUS", 128)
    monkeypatch.setattr(bt, "FLOW_SETTINGS", ((1, 1), (2, 2)))
    assert bt.main(["--quick", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in (
        "busbw_gain_vs_ecmp_median_pct",
        "pct_of_ideal",
        "plan_time_s_4096",
        "replan_time_ms",
        "plan_enforce_time_s_4096",
        "hard_pct_of_ideal",
        "hard_busbw_gain_vs_ecmp_median_pct",
        "hard_plan_enforce_time_s_4096",
    ):
        assert key in summary
    assert summary["plan_enforce_time_s_4096"] >= summary["plan_time_s_4096"]
    sweep = summary["ecmp_settings"]
    assert [(e["channels"], e["qps_per_connection"]) for e in sweep] == [(1, 1), (2, 2)]
    assert all(e["speedup_vs_ecmp_median"] > 0 for e in sweep)
    assert "flow-level model" in summary["model"]
    assert 0 < summary["hard_pct_of_ideal"] <= 100.0 + 1e-6
