"""bench.recovery's torchrun baseline: the figures read from a run's step log and output.

The real run (torchrun, four gloo ranks) is what ``python -m bench.recovery`` does; here
its analysis is fed the log a run of that schedule writes, so each figure is pinned.
"""

from __future__ import annotations

from typing import Any

from bench.recovery import summarize
from bench.recovery_torchrun import BaselineConfig, analyse, fault_spec

CFG = BaselineConfig(
    warmup_steps=4,
    straggler_delay_s=0.25,
    ckpt_every=5,
    step_sleep_s=0.1,
    pg_timeout_s=20.0,
    default_timeout_s=1800.0,
)


def _run_log() -> tuple[list[dict[str, Any]], list[tuple[float, str]], float]:
    """Launch 0 hangs at step 38 (its newest checkpoint, 35, holds steps 0-34: 35-37 are
    lost); launch 1 resumes from 35 and runs to 41; the lost GPU crashes every launch at
    step 42; launches 2 and 3 resume from checkpoint 40 and crash at 42 again."""
    rows: list[dict[str, Any]] = []
    t = 1000.0
    for step in range(CFG.hang_step):  # 0..37
        t += 0.2 if step < CFG.warmup_steps else 0.45
        rows.append({"step": step, "generation": 0, "time_unix_s": t})
    hang_t = t
    output = [(900.0, "demojob: generation 0 started fresh at step 0 (tp=2 dp=2)\n")]
    output.append((hang_t + 20.5, "RuntimeError: ... Timed out waiting 20000ms for recv\n"))
    t = hang_t + 40.0
    output.append((t - 1, "demojob: generation 1 resumed from step 35 (tp=2 dp=2 -> tp=2 dp=2)\n"))
    for i, step in enumerate(range(35, CFG.xid_step)):  # 35..41
        row = {"step": step, "generation": 1, "time_unix_s": t + 0.45 * i}
        if i == 0:
            row["resumed_from"] = 35
        rows.append(row)
    for gen in (2, 3):
        output.append((t + 10 * gen, f"demojob: generation {gen} resumed from step 40 (tp=2)\n"))
        for step in (40, 41):
            rows.append({"step": step, "generation": gen, "time_unix_s": t + 10 * gen + step})
    return rows, output, t + 60.0


def test_analysis_of_a_baseline_run() -> None:
    rows, output, ended = _run_log()
    r = analyse(CFG, rows, output, started_unix_s=990.0, ended_unix_s=ended)
    straggler, hang, xid = r["faults"]
    assert straggler["recover_s"] is None and straggler["detect_s"] is None
    # Noticed when gloo's timeout fired; recovered at the restarted launch's first step.
    assert hang["detect_s"] == 20.5 and hang["recover_s"] == 40.0
    assert hang["steps_lost"] == CFG.hang_step - 35
    # Two restarts on the lost GPU (3 in all with the hang's: --max-restarts spent).
    assert xid["restarts_on_lost_gpu"] == 2 and xid["recover_s"] is None
    # Steps at or past the newest checkpoint (40) that launches 1-3 ran and lost.
    assert xid["steps_lost"] == 2 + 2 + 2
    assert r["unrecovered"] == ["straggler", "xid"]
    assert r["mttr_s"] == 40.0
    assert r["inputs"]["steps_kept"] == 40
    assert r["inputs"]["step_s"] == 0.2
    assert r["goodput"] == round(40 * 0.2 / r["inputs"]["wall_s"], 4)
    slower = r["at_default_timeout"]
    assert slower["mttr_s"] == 40.0 + 1800.0 - 20.0 and slower["goodput"] < r["goodput"]
    assert r["at_nccl_default_timeout"]["goodput"] > slower["goodput"]
    assert "measured here" in r["how"] and "extrapolated" in slower["how"]


def test_fault_spec_follows_the_drills_schedule() -> None:
    delay, hang, crash = fault_spec(CFG)
    assert delay["from_step"] == CFG.warmup_steps and "generation" not in delay
    assert hang["at_step"] == 2 * CFG.warmup_steps + 30 and hang["generation"] == 0
    assert crash["from_step"] == CFG.hang_step + CFG.warmup_steps and "generation" not in crash


def test_summary_carries_both_sides() -> None:
    rows, output, ended = _run_log()
    base = analyse(CFG, rows, output, started_unix_s=990.0, ended_unix_s=ended)
    faults = [
        {"fault": "straggler", "detect_s": 6.0, "recover_s": 20.0, "steps_lost": 3,
         "world_after": 4},
        {"fault": "hang", "detect_s": 4.0, "recover_s": 18.0, "steps_lost": 4, "world_after": 4},
        {"fault": "xid", "detect_s": 1.0, "recover_s": 15.0, "steps_lost": 2, "world_after": 4},
    ]  # fmt: skip
    run = {"faults": faults, "ckpt_every": 5, "goodput_pct": 70.0, "step_s": 0.2,
           "straggler_delay_s": 0.25, "warmup_steps": 4}  # fmt: skip
    s = summarize([run], [base])
    assert s["goodput"] == 0.7 and s["mttr_s"] == 18.0 and s["steps_lost"] == 9
    assert s["baseline_goodput"] == base["goodput"] and s["baseline_mttr_s"] == 40.0
    assert s["baseline_steps_lost"] == base["steps_lost"]
    assert s["baseline_unrecovered"] == ["straggler", "xid"]
    assert s["baseline_mttr_s_default_timeout"] == 1820.0
    assert "measured here" in s["labels"]["baseline_goodput"]
