"""bench.detect's fleet figures (issue 16): the keys, and trainguard beside the baseline."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.detect_fleet import BASELINE_NAME, FleetSet, dev_set, measure


def _short(fleet: FleetSet) -> FleetSet:
    """The development set, cut short so the check runs in seconds."""
    return FleetSet(
        pp=replace(fleet.pp, steps=150),
        moe=replace(fleet.moe, steps=150),
        heavy=replace(fleet.heavy, steps=150),
        flap=replace(fleet.flap, steps=260),
        multi=[replace(fleet.multi[0], steps=120)],
        role_straggler=fleet.role_straggler,
        hang_quiet=fleet.hang_quiet,
    )


def test_fleet_figures_carry_the_issue_keys_for_trainguard_and_the_baseline() -> None:
    res = measure(_short(dev_set(quick=True)), seeds=[1])
    tg, base = res["trainguard"], res["baseline"]
    keys = {
        "pp_false_positives",
        "moe_false_positives",
        "heavy_tail_false_positives_per_1k_steps",
        "flapping_incidents_per_flapping_node",
        "multi_culprit_accuracy",
        "role_straggler_detect_steps_p50",
    }
    assert keys <= tg.keys() and keys <= base.keys()
    assert base["name"] == BASELINE_NAME
    assert tg["pp_false_positives"] == 0 and tg["moe_false_positives"] == 0
    assert tg["flapping_incidents_per_flapping_node"] == 1
    assert tg["multi_culprit_accuracy"] == 1.0
    assert tg["role_straggler_detect_steps_p50"] <= 50
    # Counted from the fault to the incident: the data that completed the verdict, then
    # its delivery on the agents' report timers.
    assert tg["role_straggler_detect_steps_p50"] >= tg["role_straggler_data_steps_p50"]
    assert tg["hang_quiet_agent_correct"] is True
    # Measured on the same runs: the threshold detector blames the busy expert and the
    # last stage, and opens one incident per slow phase of the flapping node.
    assert base["moe_false_positives"] > 0 and base["pp_false_positives"] > 0
    assert base["flapping_incidents_per_flapping_node"] > 1


def test_gloo_figures_are_pooled_with_the_generator_and_the_generator_kept_apart() -> None:
    """False positives add up; the role straggler's figure is the real gloo runs' own (the
    job's steps until the incident opened, as deployed), the generator's kept under sim."""
    from bench.detect import pool_gloo

    fleet: dict[str, Any] = {
        "pp_false_positives": 0,
        "moe_false_positives": 1,
        "role_straggler_detect_steps": [10, 12, 14],
        "role_straggler_detect_steps_p50": 12,
        "role_straggler_data_steps_p50": 9,
        "role_straggler_detected": 1.0,
    }
    gloo: dict[str, Any] = {
        "pp_false_positives": 2,
        "moe_false_positives": 0,
        "tp_mixed_false_positives": 0,
        "role_straggler_detect_steps": [30, 40],
        "role_straggler_detect_steps_p50": 35.0,
        "role_straggler_data_steps_p50": 20.0,
        "role_straggler_detected": 0.5,
    }
    pool_gloo(fleet, gloo)
    assert (fleet["pp_false_positives"], fleet["moe_false_positives"]) == (2, 1)
    assert fleet["role_straggler_detect_steps_p50"] == 35.0
    assert fleet["role_straggler_data_steps_p50"] == 20.0
    assert fleet["role_straggler_detected"] == 0.5
    assert fleet["sim"]["role_straggler_detect_steps_p50"] == 12
    assert fleet["sim"]["pp_false_positives"] == 0 and fleet["tp_mixed_false_positives"] == 0
