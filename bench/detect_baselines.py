"""What a job gets without trainguard, on bench.detect's scenario matrix: two baselines.

- ``pytorch defaults``: torch.distributed and torchrun as they ship. A hung collective is
  noticed when the process group's timeout fires (NCCL's documented default, 10 min; the
  NCCL heartbeat monitor, 8 min by default, only fires when the watchdog itself is stuck),
  and the error is raised on every rank, so nothing is localized. A crashed or killed rank
  is noticed by torchrun within its 0.1 s monitor interval and named in its error (the
  failed local rank). Stragglers, slow links and NaN gradients raise nothing.
- ``flight recorder``: the same timeout, with ``TORCH_NCCL_DUMP_ON_TIMEOUT`` dumping every
  surviving rank's Flight Recorder buffer; the culprit is what the Flight Recorder analysis
  (``trainguard.flight_recorder.analyze``, the same code the controller runs on a hang's
  dumps) reads from the dumps each scenario leaves: the ranks that never entered the
  collective the others are stuck in. Without a hang there is no dump and no culprit.

Both are *derived*: the times are documented defaults, not measured (waiting 10 min per
scenario is not a benchmark); the Flight Recorder culprit is computed by running the real
analysis on dumps built from the scenario's state. False positives are zero by
construction: neither raises anything while the job runs.
"""

from __future__ import annotations

import statistics
from typing import Any

from trainguard.flight_recorder import analyze

NCCL_TIMEOUT_S = 600.0
"""NCCL process groups' default timeout (torch docs: 10 minutes)."""
TORCHRUN_MONITOR_S = 0.1
"""torchrun's ``--monitor-interval`` default."""
GROUP = "0"


def _entry(seq: int, state: str = "scheduled") -> dict[str, Any]:
    return {
        "process_group": [GROUP, "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[1024]],
        "output_sizes": [[1024]],
        "state": state,
        "time_created_ns": seq * 1_000_000,
        "is_p2p": False,
    }


def flight_culprit(world: int, *, hang_rank: int | None, crash_rank: int | None) -> list[int]:
    """Dumps as the scenario leaves them at the timeout, through the real analysis.

    Hang: every rank but ``hang_rank`` entered collective ``seq`` (started, never done);
    the hung rank's newest entry is the one before. Crash: the dead rank dumps nothing; the
    others sit in the collective it never joined."""
    seq = 100
    dumps: dict[int, dict[str, Any]] = {}
    for r in range(world):
        if r == crash_rank:
            continue
        entries = [_entry(s, "completed") for s in range(seq - 3, seq)]
        if r != hang_rank:
            entries.append(_entry(seq, "started"))
        dumps[r] = {"entries": entries}
    found = analyze(dumps, {GROUP: list(range(world))})
    return sorted({r for d in found for r in d.missing})


def _outcome(
    scenario: Any, world: int, *, flight: bool
) -> tuple[bool, tuple[int, ...], float | None]:
    """(detected, named ranks, seconds from the fault until the job notices)."""
    if scenario.hang_rank is not None:
        named = (
            tuple(flight_culprit(world, hang_rank=scenario.hang_rank, crash_rank=None))
            if flight
            else ()
        )
        return True, named, NCCL_TIMEOUT_S
    if scenario.crash_rank is not None:
        if flight:
            # torchrun stops the job at the exit, before any timeout or dump: the dumps only
            # come if the job were left to time out, and then name nobody (the dead rank
            # does not dump); report what the analysis of those dumps says.
            named = tuple(flight_culprit(world, hang_rank=None, crash_rank=scenario.crash_rank))
            return True, named, NCCL_TIMEOUT_S
        return True, (scenario.crash_rank,), TORCHRUN_MONITOR_S
    return False, (), None


def baseline_figures(
    scenarios: list[Any], seeds: int, world: int, healthy_steps: int, *, flight: bool
) -> dict[str, Any]:
    """The figures trainguard reports on the same scenario matrix, for one baseline."""
    correct = total = 0
    hang_s: list[float] = []
    rows = []
    for sc in scenarios:
        detected, named, detect_s = _outcome(sc, world, flight=flight)
        ok = detected and named == tuple(sorted(sc.culprit))
        total += seeds
        correct += seeds * ok
        if sc.hang_rank is not None and detect_s is not None:
            hang_s.append(detect_s)
        rows.append(
            {
                "scenario": sc.name,
                "detected": f"{seeds * detected}/{seeds}",
                "named": list(named),
                "correct": ok,
                "detect_s": detect_s,
            }
        )
    name = "flight recorder (dump on timeout)" if flight else "pytorch defaults"
    return {
        "name": name,
        "how": "derived: documented default timeouts; "
        + ("culprit from trainguard.flight_recorder.analyze" if flight else "no localization"),
        "localization_accuracy": round(correct / total, 3),
        "false_positives_per_1k_steps": 0.0,
        "healthy_steps": healthy_steps,
        "hang_detect_s_p50": statistics.median(hang_s) if hang_s else None,
        "straggler_detect_steps_p50": None,
        "detect_s": [r["detect_s"] for r in rows for _ in range(seeds)],
        "scenarios": rows,
    }
