"""``comm_slow`` beside a pipeline straggler while the whole host slows down.

The layout of the end-to-end test ``test_pipeline_straggler_roles_come_from_a_real_device_mesh``:
2 pipeline stages x 2 replicas, the last stage computing 60% longer (50 ms and 80 ms), one
all-reduce a step over the whole job, rank 1 delayed 30 ms a step from step 150. On a
CPU-starved host every rank's compute *and* the transfers stretch together (a burst of
1.5-2x for ~15 s). Found (simulated here, 3 seeds each):

* with the straggler open, nothing opens: its explanation (~34 ms a step) covers any rise;
* before it opens, a 2x host-wide burst opened ``comm_slow`` once the transfers were 10% or
  more of the step (at 20%, 1.7x was enough), ~30 steps after the burst began, and then
  "resolved" when the straggler's explanation arrived, while the burst went on. At 3 ms of
  a 83 ms step (the e2e job's share) a proportional burst stays under the 5%-of-step bar.

The detector's premise is a wait rising while compute stays even; a host-wide slowdown
raises both, so a wait rise no larger than the job's compute rise is now the hosts'. Pure
records through ``JobTrackers`` on a simulated clock: no sockets, no sleeps.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from controller.logic.detection.c4d import C4DConfig, Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.comm_slow import CommSlowState
from trainguard.wire import JobRecords, StepSummary

JOB = "pipeline"
STAGE_S = {0: 0.05, 1: 0.08}  # the last stage computes the loss: 60% longer
DELAYED_RANK, DELAY_S, DELAY_FROM = 1, 0.03, 150


def stage_fields(rank: int) -> dict[str, Any]:
    stage = rank // 2
    return {
        "role": f"pp_stage={stage}",
        "pp_stage": stage,
        "group_ranks": [2 * stage, 2 * stage + 1],
    }


def drive(
    steps: int,
    *,
    comm_s: float,
    host: tuple[int, int, float] = (0, 0, 1.0),
    net: tuple[int, int, float] = (0, 0, 1.0),
    seed: int = 0,
) -> list[Finding]:
    """The job's ``steps`` steps, one report per node per step, the clock at each step's end.

    ``host`` (first, last step, factor): every rank's compute and the transfer slower by it.
    ``net`` (first, last step, factor): the transfer alone slower by it (compute even)."""
    rng = random.Random(seed)
    trackers, found, now = JobTrackers(), [], 0.0
    for step in range(steps):
        h = host[2] if host[0] <= step < host[1] else 1.0
        n = net[2] if net[0] <= step < net[1] else 1.0
        compute = {r: STAGE_S[r // 2] * h * (1 + rng.uniform(-0.05, 0.05)) for r in range(4)}
        if step >= DELAY_FROM:
            compute[DELAYED_RANK] += DELAY_S
        top = max(compute.values())
        transfer = comm_s * h * n * (1 + rng.uniform(-0.1, 0.1))
        now += top + transfer
        for node in (0, 1):
            rows = [
                StepSummary(
                    job=JOB,
                    rank=r,
                    world_size=4,
                    step=step,
                    compute_time_s=compute[r],
                    collective_wait_s=top - compute[r] + transfer,
                    step_time_s=top + transfer,
                    gpu_index=r % 2,
                    **stage_fields(r),
                )
                for r in (2 * node, 2 * node + 1)
            ]
            trackers.observe(f"node-{node}", JobRecords(steps=rows), now)
        found += trackers.evaluate(now)
    return found


def opened(found: list[Finding]) -> list[tuple[FindingKind, tuple[int, ...]]]:
    return [(f.kind, f.ranks) for f in found if not (f.refresh or f.resolved)]


STRAGGLER_ONLY = [(FindingKind.STRAGGLER, (DELAYED_RANK,))]
ALL_RANKS = (0, 1, 2, 3)


@pytest.mark.parametrize(("comm_s", "factor"), [(0.02, 1.7), (0.02, 2.0), (0.01, 2.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_host_wide_slowdown_before_the_straggler_opens_no_comm_slow(
    comm_s: float, factor: float, seed: int
) -> None:
    """Steps 60-240 (~17 s) every rank computes and transfers ``factor`` x slower. The old
    detector opened ``comm_slow`` at step ~90 (the wait rose 10-20 ms, over 5% of the step)
    and a probe round with it; only the straggler is real."""
    found = drive(320, comm_s=comm_s, host=(60, 240, factor), seed=seed)
    assert opened(found) == STRAGGLER_ONLY


@pytest.mark.parametrize("comm_s", [0.003, 0.02])
def test_a_host_wide_slowdown_while_the_straggler_is_open_opens_nothing_more(
    comm_s: float,
) -> None:
    """Control: the straggler open (from step ~162), a 2x burst at steps 250-430."""
    found = drive(520, comm_s=comm_s, host=(250, 430, 2.0))
    assert opened(found) == STRAGGLER_ONLY


def test_a_slower_network_with_compute_even_still_opens_comm_slow() -> None:
    """Control, the detector's premise: the transfer 3x slower (20 -> 60 ms) from step 60,
    compute as before, opens ``comm_slow`` on every rank before the straggler exists."""
    found = drive(140, comm_s=0.02, net=(60, 140, 3.0))
    (slow,) = [f for f in found if f.kind is FindingKind.COMM_SLOW]
    assert opened(found) == [(FindingKind.COMM_SLOW, ALL_RANKS)]
    assert "slower compute" not in slow.summary


def test_a_network_much_slower_than_the_hosts_still_opens_comm_slow() -> None:
    """Control: during a 2x host-wide slowdown the transfer gets 4x slower on top (20 ->
    160 ms): compute accounts for 20 ms of the 140 ms rise, the rest is the network's."""
    found = drive(150, comm_s=0.02, host=(60, 150, 2.0), net=(60, 150, 4.0))
    (slow,) = [f for f in found if f.kind is FindingKind.COMM_SLOW]
    assert opened(found) == [(FindingKind.COMM_SLOW, ALL_RANKS)]
    host_ms = re.search(r", ([\d.]+) ms of it matching the job's slower compute", slow.summary)
    assert host_ms and 18 <= float(host_ms.group(1)) <= 22, slow.summary  # 1x the 20 ms


def test_an_open_straggler_and_a_slow_host_do_not_hide_a_much_slower_network() -> None:
    """Control: straggler open, then a 1.5x host burst with the transfer 10x slower on top
    (20 -> 300 ms): more than the straggler and the hosts together account for."""
    found = drive(320, comm_s=0.02, host=(200, 320, 1.5), net=(200, 320, 10.0))
    assert opened(found) == [*STRAGGLER_ONLY, (FindingKind.COMM_SLOW, ALL_RANKS)]
    (slow,) = [f for f in found if f.kind is FindingKind.COMM_SLOW]
    assert slow.evidence.as_json()["straggler_explained_s"] > 0


def feed(state: CommSlowState, steps: int, wait_s: float, compute_s: float, t0: float) -> list[str]:
    """``steps`` steps of 1 s each from ``t0``; the changes the detector reports."""
    changes = []
    for i in range(steps):
        noise = 1 + 0.02 * ((i * 7) % 5 - 2)
        change = state.add(wait_s * noise, 1.0, 0.0, t0 + i, compute_s=compute_s * noise)
        if change:
            changes.append(change)
    return changes


def test_the_wait_is_expected_to_scale_with_the_jobs_compute_only_upward() -> None:
    """The rule on its own: a 2x wait beside 2x compute opens nothing; the same 2x wait
    with compute even, or with compute halved (no lower expectation), opens."""
    for compute_after, expect in ((0.8, []), (0.4, ["opened"]), (0.2, ["opened"])):
        state = CommSlowState(C4DConfig())
        assert feed(state, 60, 0.1, 0.4, 0.0) == []
        assert feed(state, 30, 0.2, compute_after, 60.0) == expect, compute_after


def test_a_wait_rising_far_beyond_compute_on_a_loaded_host_still_reads_as_the_network() -> None:
    """The documented blind spot: loopback transfers are CPU work and a sleeping "compute"
    is not, so a starved host can show 1.3x compute with 10x transfers (3 -> 30 ms). From
    the step records that is a slower network; the probe round is the arbiter."""
    found = drive(150, comm_s=0.003, host=(60, 150, 1.3), net=(60, 150, 10 / 1.3))
    assert opened(found) == [(FindingKind.COMM_SLOW, ALL_RANKS)]
