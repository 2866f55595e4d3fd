"""The detection scenario matrix of bench.detect, as a correctness check (no timing)."""

from __future__ import annotations

import pytest

from bench.detect import SCENARIOS, Scenario, run


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_each_fault_names_its_culprit_and_nothing_else(scenario: Scenario) -> None:
    outcome = run(scenario, seed=11)
    assert outcome.detected, scenario.name
    assert outcome.named == tuple(sorted(scenario.culprit))
    assert outcome.extra == []
    assert outcome.correct


def test_stragglers_are_found_within_thirty_steps_and_hangs_within_ten_seconds() -> None:
    for scenario in SCENARIOS:
        outcome = run(scenario, seed=12)
        if scenario.hang_rank is not None:
            assert outcome.detect_s is not None and outcome.detect_s <= 10
        elif scenario.slow:
            assert outcome.detect_steps is not None, f"{scenario.name}: not detected"
            assert outcome.detect_steps <= 30, scenario.name


def test_a_long_healthy_run_with_heavy_jitter_opens_nothing() -> None:
    outcome = run(Scenario("healthy", (), (), jitter=0.2, steps=3000), seed=13)
    assert outcome.extra == [] and outcome.correct
