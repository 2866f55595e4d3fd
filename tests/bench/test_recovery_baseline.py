"""bench.recovery's side-by-side keys: trainguard's measured run beside torchrun's (derived)."""

from __future__ import annotations

from typing import Any

from bench.recovery import NCCL_DEFAULT_TIMEOUT_S, summarize, torchrun_baseline


def _run() -> dict[str, Any]:
    """A run's shape as ``one_run`` returns it (figures like a --quick run's)."""
    faults = [
        {"fault": "straggler", "detect_s": 6.0, "recover_s": 20.0, "steps_lost": 3,
         "world_after": 4},
        {"fault": "hang", "detect_s": 4.0, "recover_s": 18.0, "steps_lost": 4, "world_after": 4},
        {"fault": "xid", "detect_s": 1.0, "recover_s": 15.0, "steps_lost": 2, "world_after": 4},
    ]  # fmt: skip
    return {
        "faults": faults,
        "ckpt_every": 5,
        "goodput_pct": 70.0,
        "step_s": 0.2,
        "straggler_delay_s": 0.25,
        "warmup_steps": 50,
    }


def test_summary_carries_both_sides() -> None:
    s = summarize([_run()])
    for key in ("goodput", "baseline_goodput", "mttr_s", "baseline_mttr_s", "steps_lost",
                "baseline_steps_lost"):  # fmt: skip
        assert key in s
    assert s["goodput"] == 0.7 and s["mttr_s"] == 18.0 and s["steps_lost"] == 9
    # The hang waits out the default process-group timeout before torchrun restarts.
    assert s["baseline_mttr_s"] > NCCL_DEFAULT_TIMEOUT_S
    assert s["baseline_unrecovered"] == ["straggler", "xid"]
    assert "derived" in s["labels"]["baseline_goodput"]


def test_baseline_uses_the_runs_measured_relaunch_cost_and_checkpoint_interval() -> None:
    run = _run()
    fast = torchrun_baseline(run, hang_timeout_s=60.0)
    assert fast["inputs_measured_here"]["relaunch_s"] == 14.0
    assert fast["faults"][1]["recover_s"] == round(60.0 + 0.1 + 14.0, 2)
    # The restarts throw away the steps since the same checkpoint trainguard restarted from.
    assert [f["steps_lost"] for f in fast["faults"]] == [0, 4, 2]
    slow = torchrun_baseline(run, hang_timeout_s=1800.0)
    assert slow["goodput_pct"] < fast["goodput_pct"] < 100.0
