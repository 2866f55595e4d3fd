"""bench.detect's PyTorch and Flight Recorder baselines on the scenario matrix (issue 21)."""

from __future__ import annotations

from typing import Any

from bench import detect_baselines_gloo as gloo
from bench.detect import SCENARIOS, WORLD
from bench.detect_baselines import NCCL_TIMEOUT_S, baseline_figures, flight_culprit
from bench.detect_baselines_gloo import SCENARIOS as GLOO_SCENARIOS


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


def _fr(seqs: list[int], started: int | None = None) -> dict[str, Any]:
    entries = [
        {"process_group": ["0", "default_pg"], "collective_seq_id": s,
         "profiling_name": "gloo:all_reduce", "input_sizes": [[1024]],
         "output_sizes": [[1024]], "state": "completed", "time_created_ns": s, "is_p2p": False}
        for s in seqs
    ]  # fmt: skip
    if started is not None:
        entries.append({**entries[-1], "collective_seq_id": started, "state": "started"})
    return {"entries": entries}


def test_measured_baselines_judge_a_hang_from_real_shaped_dumps() -> None:
    """What bench.detect_baselines_gloo reads from a hang run: rank 2 never entered the
    collective the others time out in; the first rank's error is the detection time."""
    sc = next(s for s in GLOO_SCENARIOS if s["name"] == "hang")
    steps = [{"step": i, "t": 100.0 + i, "finite": True} for i in range(gloo.FAULT_STEP)]
    t_fault = steps[-1]["t"]
    dumps = {
        r: {"noticed_unix_s": t_fault + (5.1 if r == 0 else 5.3), "why": "RuntimeError: Timed out",
            "fr": _fr([1, 2, 3], started=4)}
        for r in (0, 1, 3)
    }  # fmt: skip
    dumps[2] = {"noticed_unix_s": t_fault + 5.4, "why": "signalled", "fr": _fr([1, 2, 3])}
    verdict = gloo.judge(sc, {"steps": steps, "dumps": dumps})
    assert verdict["detected"] and verdict["detect_s"] == 5.1
    assert verdict["flight_named"] == [2] and not verdict["false_positive"]
    assert verdict["healthy_steps"] == gloo.FAULT_STEP


def test_measured_baselines_count_an_error_in_a_healthy_run_as_a_false_positive() -> None:
    sc = next(s for s in GLOO_SCENARIOS if s["name"] == "healthy")
    steps = [{"step": i, "t": 100.0 + i, "finite": True} for i in range(10)]
    dumps = {0: {"noticed_unix_s": 111.0, "why": "RuntimeError: x", "fr": _fr([1])}}
    verdict = gloo.judge(sc, {"steps": steps, "dumps": dumps})
    assert verdict["false_positive"] and verdict["healthy_steps"] == 10
    quiet = gloo.judge(sc, {"steps": steps, "dumps": {}})
    assert not quiet["detected"] and not quiet["false_positive"]
