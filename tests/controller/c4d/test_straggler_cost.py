"""What a straggler is said to cost: its extra time per step and its share of each step.

Found in simulation (2 pipeline stages x 2 replicas, stages of 50 and 80 ms, rank 1 +30 ms
a step): the reference was the median compute of the rank's whole peer group, the
straggler included, so in a group of two it was the mean of the straggler and its peer and
a 30 ms delay was credited ~45 ms a step (``extra_s``, which ``explained_wait_s`` discounts
a ``comm_slow`` rise by); a rank alone in its group was referred to its own (slow) compute.
The step cost read "~43% of each step" though the other stage took 80 ms anyway and the job
lost next to nothing. Now the reference is the compute the rank takes when healthy (its
peers' median, or its own history's), and the cost is the time the job waited for it.

Pure records of a synchronous job (every rank waits at the step's collective for the last
one, then the transfer), fed straight to :class:`StragglerState`: no sockets, no sleeps.
The true cost is computed from the same simulation: the step's end with the rank as it is,
less its end had the rank computed its healthy time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.straggler import StragglerState
from trainguard.wire import StepSummary

COMM_S = 0.01
SLOW_RANK = 1
STEPS = 120


def _fields(rank: int, stage_of: dict[int, int] | None) -> dict[str, Any]:
    if stage_of is None:
        return {}
    stage = stage_of[rank]
    members = sorted(r for r, s in stage_of.items() if s == stage)
    return {"role": f"pp_stage={stage}", "pp_stage": stage, "group_ranks": members}


def _simulate(
    healthy_s: dict[int, float],
    delay_s: float,
    *,
    jitter: float = 0.02,
    stage_of: dict[int, int] | None = None,
    delay_from: int = 0,
    seed: int = 0,
) -> tuple[StragglerState, float, float]:
    """Drive ``STEPS`` synchronous steps, rank ``SLOW_RANK`` ``delay_s`` slower from step
    ``delay_from``. Returns the state, the true seconds per step the job lost to the rank
    (mean over the last window) and the mean step time over it."""
    rng = random.Random(seed)
    state = StragglerState(C4DConfig())
    window = state.cfg.window_steps
    lost: list[float] = []
    steps: list[float] = []
    for step in range(STEPS):
        compute = {r: h * (1 + rng.uniform(-jitter, jitter)) for r, h in healthy_s.items()}
        healthy_top = max(compute.values())
        if step >= delay_from:
            compute[SLOW_RANK] += delay_s
        top = max(compute.values())
        state.add(step, _rows(step, compute, lambda r: _fields(r, stage_of)))
        state.transitions()
        if step >= STEPS - window:
            lost.append(top - healthy_top)
            steps.append(top + COMM_S)
    return state, sum(lost) / len(lost), sum(steps) / len(steps)


def _rows(
    step: int, compute: dict[int, float], fields: Callable[[int], dict[str, Any]] = lambda r: {}
) -> dict[int, StepSummary]:
    """One synchronous collective a step: every rank leaves it together, COMM_S after the
    slowest arrives, so each waits the gap to the slowest plus the transfer."""
    top = max(compute.values())
    return {
        r: StepSummary(
            job="j",
            rank=r,
            world_size=len(compute),
            step=step,
            compute_time_s=c,
            collective_wait_s=top - c + COMM_S,
            step_time_s=top + COMM_S,
            **fields(r),
        )
        for r, c in compute.items()
    }


def _extra_s(state: StragglerState) -> float:
    """Seconds per step the straggler may explain of a rise in the job's shortest wait."""
    return state.explained_wait_s({SLOW_RANK})


@pytest.mark.parametrize("world", [2, 3, 4, 8, 64])
def test_a_data_parallel_straggler_is_credited_its_own_delay_at_every_group_size(
    world: int,
) -> None:
    """0.1 s of compute, rank 1 +30 ms, +-2% jitter. ``extra_s`` is the delay plus the noise
    margin (5 standard errors, at least 5% of the healthy compute in logs): before, with 2
    ranks, 30 ms read as ~42 ms. The step cost is the time the job actually waited for it:
    in 64 jittery ranks the slowest healthy one is ~2 ms behind anyway."""
    state, lost_s, step_s = _simulate({r: 0.1 for r in range(world)}, 0.03)
    assert SLOW_RANK in state.open_ranks
    assert 0.03 <= _extra_s(state) <= 0.03 + 0.009, world
    assert state.step_cost(SLOW_RANK) == pytest.approx(lost_s / step_s, abs=0.01), world
    ev = state.evidence(SLOW_RANK, "n0", 0)
    assert ev.step_cost_pct == pytest.approx(100 * lost_s / step_s, abs=1.0)
    assert ev.slowdown_pct == pytest.approx(30.0, abs=2.0)


def test_a_straggler_whose_stage_is_slower_anyway_costs_the_job_next_to_nothing() -> None:
    """The colleague's layout: stages of 50 and 80 ms x 2 replicas, rank 1 (stage 0) +30 ms,
    +-5% jitter. It now takes as long as the other stage, which the job waited for anyway.
    Before: extra ~45 ms and a cost of ~43% of each step; the job lost ~1 ms a step."""
    stages = {0: 0, 1: 0, 2: 1, 3: 1}
    healthy = {0: 0.05, 1: 0.05, 2: 0.08, 3: 0.08}
    state, lost_s, step_s = _simulate(healthy, 0.03, jitter=0.05, stage_of=stages)
    assert SLOW_RANK in state.open_ranks
    assert 0.03 <= _extra_s(state) <= 0.03 + 0.006
    assert lost_s / step_s < 0.03
    assert state.step_cost(SLOW_RANK) == pytest.approx(lost_s / step_s, abs=0.02)


def test_a_straggler_on_the_critical_path_costs_what_it_outlasts_the_other_stage_by() -> None:
    """Stages of 50 and 60 ms: rank 1 at 80 ms ends each step ~18 ms later than the other
    stage would (not its whole 30 ms: 12 ms of it was slack)."""
    stages = {0: 0, 1: 0, 2: 1, 3: 1}
    healthy = {0: 0.05, 1: 0.05, 2: 0.06, 3: 0.06}
    state, lost_s, step_s = _simulate(healthy, 0.03, stage_of=stages)
    assert SLOW_RANK in state.open_ranks
    assert 0.03 <= _extra_s(state) <= 0.03 + 0.006
    assert 0.2 < lost_s / step_s < 0.25
    assert state.step_cost(SLOW_RANK) == pytest.approx(lost_s / step_s, abs=0.01)


def test_a_rank_alone_in_its_stage_is_credited_its_delay_not_its_slow_compute() -> None:
    """Two stages of one rank each (60 and 50 ms): rank 1 is compared with its own history
    (learned over its first 60 steps), then +30 ms. Its reference was its own slow compute
    (80 ms), so 30 ms read as ~55 ms and a cost of ~54% of each step; the job lost ~22%."""
    stages = {0: 0, 1: 1}
    healthy = {0: 0.06, 1: 0.05}
    state, lost_s, step_s = _simulate(healthy, 0.03, stage_of=stages, delay_from=60)
    assert SLOW_RANK in state.open_ranks
    assert 0.03 <= _extra_s(state) <= 0.03 + 0.006
    assert state.step_cost(SLOW_RANK) == pytest.approx(lost_s / step_s, abs=0.01)


def test_slow_ranks_of_one_node_each_cost_the_job_their_delay() -> None:
    """Four ranks of 16 (one node) +30 ms: each alone would cost the job nothing (the other
    three are as slow), but the job waits for them; each is said to cost the step's share
    the node costs, not zero."""
    rng = random.Random(5)
    state = StragglerState(C4DConfig())
    slow = {4, 5, 6, 7}
    for step in range(STEPS):
        compute = {r: 0.1 * (1 + rng.uniform(-0.02, 0.02)) for r in range(16)}
        healthy_top = max(compute.values())
        for r in slow:
            compute[r] += 0.03
        top = max(compute.values())
        state.add(step, _rows(step, compute))
        state.transitions()
    assert state.open_ranks == slow
    share = (top - healthy_top) / (top + COMM_S)
    for r in slow:
        assert state.step_cost(r) == pytest.approx(share, abs=0.03), r
