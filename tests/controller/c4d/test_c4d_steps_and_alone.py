"""Straggler persistence counted in steps, and ranks that have no peer (issue 16).

Summaries reach the controller in batches, one agent report interval at a time (5 s: ~70
steps of a 70 ms job), so the straggler rules count compared steps, never the controller's
clock. A rank alone in its peer group (a pipeline stage without a data-parallel replica)
is compared with its own history relative to the rest of the job.
"""

from __future__ import annotations

import random

from bench.detect_sim import Layout, Noise, SimScenario, run_sim
from controller.logic.detection.c4d import Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.evidence import Normalization, StragglerEvidence
from controller.logic.detection.c4d.peers import PeerBasis, PeerKey
from trainguard.wire import JobRecords, StepSummary

STEP_S = 0.07


def _step(
    step: int, world: int, slow: dict[int, float], rng: random.Random, **fields: object
) -> list[StepSummary]:
    compute = {
        r: STEP_S * (1 + slow.get(r, 0.0)) * (1 + rng.uniform(-0.05, 0.05)) for r in range(world)
    }
    top = max(compute.values())
    return [
        StepSummary(
            job="short",
            rank=r,
            world_size=world,
            step=step,
            step_time_s=top + 0.005,
            compute_time_s=c,
            collective_wait_s=top - c + 0.005,
            **fields,
        )
        for r, c in compute.items()
    ]


def _stragglers(found: list[Finding]) -> list[tuple[int, ...]]:
    return [
        f.ranks for f in found if f.kind is FindingKind.STRAGGLER and not (f.resolved or f.refresh)
    ]


def test_one_report_batch_of_short_steps_names_the_straggler_within_its_steps() -> None:
    """150 steps of 70 ms (one 10 s agent report) arrive and are compared at one instant:
    the verdict needs steps of data, not seconds of the controller's clock, so the rank
    slowed 15% from step 40 is named from this one batch, ~15 steps into its slowdown."""
    rng = random.Random(1)
    rows = [s for step in range(150) for s in _step(step, 16, {5: 0.15} if step >= 40 else {}, rng)]
    trackers = JobTrackers()
    trackers.observe("n0", JobRecords(steps=rows), 100.0)
    found = trackers.evaluate(100.0)
    assert _stragglers(found) == [(5,)]
    ev = StragglerEvidence.model_validate(found[0].evidence)
    assert ev.at_step is not None and 40 < ev.at_step <= 40 + 25
    assert trackers.jobs["short"].last_compared_step == 149


def test_a_rank_slow_for_fewer_steps_than_half_a_window_opens_nothing() -> None:
    """A burst of 8 steps at +60% on one rank (half a second of a 70 ms job: CPU contention,
    a page-fault storm) never moves its 20-step median: no incident, however short the
    steps and however fast the summaries arrive."""
    rng = random.Random(2)
    trackers = JobTrackers()
    found: list[Finding] = []
    for step in range(200):
        slow = {3: 0.6} if 80 <= step < 88 else {}
        trackers.observe("n0", JobRecords(steps=_step(step, 16, slow, rng)), step * STEP_S)
        found += trackers.evaluate(step * STEP_S)
    assert found == []


# ---------------------------------------------------------------- a rank with no peer

PURE_PP = Layout(kind="pp", world=4, pp=4, per_node=4)  # 4 stages, no data-parallel replica


def test_a_stage_without_a_replica_is_compared_with_its_own_history() -> None:
    sc = SimScenario(name="alone", layout=PURE_PP, slow={2: 0.15}, fault_step=100, steps=260)
    out = run_sim(sc, seed=3)
    assert [(f.kind, f.ranks) for _, f in out.opened] == [(FindingKind.STRAGGLER, (2,))]
    (step, _), *_ = out.opened
    assert step - sc.fault_step <= 50
    ev = StragglerEvidence.model_validate(out.straggler_updates[0].evidence)
    assert ev.normalization is Normalization.OWN_HISTORY
    assert ev.peer_group.ranks == [2] and ev.peer_group.basis is PeerBasis.GROUP_RANKS
    assert "only rank" in ev.peer_group.why and "own history" in ev.peer_group.why
    # What it is compared with: its own first 60 compared steps.
    assert ev.compute_s.peers.steps == 60 and ev.compute_s.culprit.steps == 20
    assert ev.compute_s.culprit.median > 1.1 * ev.compute_s.peers.median
    assert ev.verdict.startswith("alone in its peer group") and 10 <= ev.slowdown_pct <= 25
    # It has no peers: the summary says what it was compared with, as its verdict does.
    summary = out.straggler_updates[0].summary
    assert "longer than its own history (" in summary and "its peers" not in summary


def test_stages_without_replicas_stay_quiet_for_2000_steps_under_heavy_tailed_noise() -> None:
    """The last stage computes 30% longer by design and spikes hit random ranks: each
    stage's history is its own, so neither opens anything."""
    noise = Noise(jitter=0.1, spike_p=0.02, spike_alpha=1.5)
    for seed in (4, 5):
        out = run_sim(SimScenario(name="pp-alone", layout=PURE_PP, noise=noise, steps=2000), seed)
        assert out.opened == [], [(s, f.summary) for s, f in out.opened]


def test_a_role_one_rank_declares_is_a_group_of_one_and_a_pair_is_not() -> None:
    rng = random.Random(6)
    trackers = JobTrackers()
    for step in range(5):
        rows = _step(step, 4, {}, rng)
        rows[0] = rows[0].model_copy(update={"role": "embedder"})
        trackers.observe("n0", JobRecords(steps=rows), float(step))
        trackers.evaluate(float(step))
    state = trackers.jobs["short"].stragglers
    assert state.groups[PeerKey("embedder", ())].alone
    assert not state.groups[PeerKey("", ())].alone
    # A group of two with one member missing from a step is skipped that step, not
    # judged alone (the member list says two).
    pair = PeerKey("pp_stage=0", (0, 1))
    rows = _step(5, 4, {}, rng, role="pp_stage=0", group_ranks=[0, 1])[:1]
    rows += _step(5, 4, {}, rng)[1:]
    trackers.observe("n0", JobRecords(steps=rows), 5.0)
    trackers.evaluate(5.0)
    assert pair not in state.groups
