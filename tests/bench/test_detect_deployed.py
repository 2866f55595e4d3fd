"""bench.detect_sim's deployed replay: agents seal reports by their own cadence rule.

The replay must deliver what a deployed agent would, when it would: the early report for
step summaries (``agents.cadence``) no sooner than its gap, the 5 s timer otherwise, and
the job's step at the incident counted from the summaries' arrival times. Synthetic
summaries (8 ranks on 4 nodes, 75 ms steps, rank 3 15% slower from step 60) stand in for
a recorded gloo run so the check runs in seconds.
"""

from __future__ import annotations

import itertools
import random
import statistics

from bench.detect_gloo import (
    CADENCES,
    PER_NODE,
    REPLAY_SEEDS,
    GlooRun,
    replays,
    reports_per_node_s,
    straggler_figures,
)
from bench.detect_sim import AgentCadence, agent_sends, node_arrivals, replay_deployed
from controller.logic.detection.c4d import FindingKind
from trainguard.wire import StepSummary

STEP_S = 0.075
FAULT = 60


def recorded(steps: int = 300) -> tuple[list[list[StepSummary]], dict[tuple[int, int], float]]:
    rng = random.Random(3)
    rows_by_step: list[list[StepSummary]] = []
    arrived: dict[tuple[int, int], float] = {}
    t = 0.0
    for step in range(steps):
        compute = {r: 0.05 * (1 + rng.uniform(-0.05, 0.05)) for r in range(8)}
        if step >= FAULT:
            compute[3] *= 1.15
        slowest = max(compute.values())
        t += slowest + 0.01
        rows = [
            StepSummary(
                job="j",
                rank=r,
                world_size=8,
                step=step,
                step_time_s=slowest + 0.01,
                compute_time_s=c,
                collective_wait_s=slowest - c + 0.01,
            )
            for r, c in compute.items()
        ]
        rows_by_step.append(rows)
        arrived |= {(step, r): t + 0.1 for r in range(8)}
    return rows_by_step, arrived


def test_agent_sends_follow_the_cadence_rule() -> None:
    steps, arrived = recorded(120)
    mine = [(arrived[(s.step, s.rank)], s) for rows in steps for s in rows if s.rank in (0, 1)]
    sealed: list[float] = []
    sends = agent_sends(mine, AgentCadence.defaults(), phase_s=2.0, sealed=sealed)
    assert sum(len(b) for _, b in sends) == 240  # every summary, once
    during = [t for t in sealed if mine[0][0] <= t <= mine[-1][0]]  # while the job steps
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert min(gaps) >= 1.0 - 1e-9  # never sooner than the gap
    assert max(gaps) < 1.0 + 2 * STEP_S  # due once 8 steps of a rank are in: ~0.6 s
    timer = agent_sends(mine, AgentCadence(job_flush_steps=0), phase_s=2.0)
    assert [t for t, _ in timer][:2] == [2.0, 7.0]


def test_the_deployed_replay_names_the_straggler_sooner_with_the_early_flush() -> None:
    steps, arrived = recorded()
    after: dict[str, list[int]] = {"default": [], "timer_5s": []}
    for name, cadence in (
        ("default", AgentCadence.defaults()),
        ("timer_5s", AgentCadence(job_flush_steps=0)),
    ):
        for seed in range(1, 6):
            res = replay_deployed(steps, arrived, 2, cadence, seed)
            assert [(f.kind, f.ranks) for _, f in res.opened] == [(FindingKind.STRAGGLER, (3,))]
            (step, _), data = res.opened[0], res.opened_data_step[0]
            assert step >= data  # the incident opens after the data that completed it
            after[name].append(step - FAULT)
    assert statistics.median(after["default"]) < statistics.median(after["timer_5s"])
    assert statistics.median(after["default"]) <= 50


def test_gloo_figures_of_a_recorded_run_group_its_ranks_by_node() -> None:
    """bench.detect_gloo's figures of one recorded run: its summaries per node's agent (two
    ranks a node, in order of arrival), reports a node's agent seals per second by the
    cadence rule, and the straggler named under every cadence, the default's the figure."""
    steps, arrived = recorded()
    nodes = node_arrivals(steps, arrived, PER_NODE)
    assert list(nodes) == ["node-0", "node-1", "node-2", "node-3"]
    for name, items in nodes.items():
        assert {s.rank // PER_NODE for _, s in items} == {int(name[5:])}
        assert len(items) == PER_NODE * len(steps)
        assert [t for t, _ in items] == sorted(t for t, _ in items)
    run = GlooRun(steps, arrived)
    rates = {name: reports_per_node_s(run, cadence) for name, cadence in CADENCES.items()}
    assert abs(rates["timer_5s"] - 0.2) < 0.02 and abs(rates["timer_1s"] - 1.0) < 0.05
    assert rates["timer_5s"] < rates["default"] <= 1.05  # the early flush: at most 1/s
    fig = straggler_figures({"culprit": 3, "fault_step": FAULT}, replays(run))
    assert fig["named"] == len(fig["named_after_steps_default"]) == len(REPLAY_SEEDS)
    for name in CADENCES:
        assert all(0 < n <= 200 for n in fig[f"named_after_steps_{name}"]), name
    assert len(fig["data_steps"]) == len(REPLAY_SEEDS)
    assert all(
        d <= n for d, n in zip(fig["data_steps"], fig["named_after_steps_default"], strict=True)
    )
