"""bench.detect's PyTorch and Flight Recorder baselines on the scenario matrix (issue 21)."""

from __future__ import annotations

from bench.detect import SCENARIOS, WORLD
from bench.detect_baselines import NCCL_TIMEOUT_S, baseline_figures, flight_culprit


def test_flight_recorder_analysis_names_the_rank_that_never_entered() -> None:
    assert flight_culprit(WORLD, hang_rank=6, crash_rank=None) == [6]
    # A dead rank dumps nothing: the survivors' dumps agree, so the analysis names nobody.
    assert flight_culprit(WORLD, hang_rank=None, crash_rank=2) == []


def test_baselines_carry_trainguards_figures_for_the_same_scenarios() -> None:
    pt = baseline_figures(SCENARIOS, 2, WORLD, 5000, flight=False)
    fr = baseline_figures(SCENARIOS, 2, WORLD, 5000, flight=True)
    keys = {
        "localization_accuracy",
        "false_positives_per_1k_steps",
        "hang_detect_s_p50",
        "straggler_detect_steps_p50",
    }
    assert keys <= pt.keys() and keys <= fr.keys()
    assert [r["scenario"] for r in pt["scenarios"]] == [s.name for s in SCENARIOS]
    assert pt["hang_detect_s_p50"] == fr["hang_detect_s_p50"] == NCCL_TIMEOUT_S
    by_pt = {r["scenario"]: r for r in pt["scenarios"]}
    by_fr = {r["scenario"]: r for r in fr["scenarios"]}
    hang = next(s.name for s in SCENARIOS if s.hang_rank is not None)
    assert by_pt[hang]["named"] == [] and not by_pt[hang]["correct"]
    assert by_fr[hang]["named"] == [6] and by_fr[hang]["correct"]
    for s in SCENARIOS:
        if s.hang_rank is None and s.crash_rank is None:
            assert by_pt[s.name]["detected"] == "0/2" and by_fr[s.name]["detect_s"] is None
    # Crashes are the one thing torchrun names by itself.
    assert 0 < pt["localization_accuracy"] < 0.5
