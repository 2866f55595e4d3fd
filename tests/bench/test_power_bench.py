"""bench.power's issue-21 figures: a latency measured through the agent path, held-out rows."""

from __future__ import annotations

import pytest

from bench.power_actuation import measure_actuation
from bench.power_heldout import NONE, OURS, POLCA, STATIC, evaluate, heldout_traces
from power.config import WorkloadKind
from power.generate import GeneratorConfig, generate

DURATION_S = 600.0


@pytest.mark.slow
def test_heldout_rows_score_every_scheme_with_parameters_from_the_training_row() -> None:
    train = generate(
        GeneratorConfig(
            kind=WorkloadKind.INFERENCE,
            servers=72,
            seed=1000,
            duration_s=DURATION_S,
            period_s=DURATION_S,
        )
    )
    held = heldout_traces(seed=0, duration_s=DURATION_S)
    assert set(held) == {"bursty", "job mix", "training swings"}
    workloads = {s.workload for s in held["job mix"].servers[:10]}
    assert workloads == {WorkloadKind.INFERENCE, WorkloadKind.TRAINING}
    rows = {r["name"]: r for r in evaluate(train, held, latency_s=1.0)}
    assert set(rows) == {OURS, NONE, STATIC, POLCA}
    for r in rows.values():
        assert {"heldout_extra_servers_pct", "heldout_hp_loss_pct"} <= r.keys()
        assert set(r["heldout_rows"]) == set(held)
    none = rows[NONE]
    assert none["chosen_extra_servers_pct"] == 0.0 and none["heldout_hp_loss_pct"] == 0.0
    # Static caps never exceed the budget: their price is throughput, not brakes.
    for h in rows[STATIC]["heldout_rows"].values():
        assert h["at_chosen"]["brake_events"] == 0 and h["at_chosen"]["violation_s"] == 0
    # Oversubscribing schemes do deploy extra servers on the training row.
    assert rows[OURS]["chosen_extra_servers_pct"] > 0


@pytest.mark.slow
def test_actuation_latency_is_measured_through_a_live_controller_and_agent() -> None:
    res = measure_actuation(samples=2, report_interval_s=0.5)
    assert len(res["samples_s"]) == 2
    # The cap rides the reply to a report and shows in a later one: at least one report
    # interval's worth of path, never a constant.
    assert all(0.05 < s < 30 for s in res["samples_s"])
    assert res["max_s"] == max(res["samples_s"])
