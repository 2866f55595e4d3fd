"""Straggler detection on job shapes and noise real fleets show (issue 16).

Peers by role (pipeline stages, MoE experts with skewed all-to-all), heavy-tailed noise,
flapping nodes, many culprits at once, summaries arriving late and in other batches, a hang
whose waiting node goes quiet, and the evidence an operator reads. The job streams come
from the benchmark's generator (``bench.detect_sim``) with each node's agent reporting on
its own timer and phase; everything runs on a virtual clock (no sleeps, no sockets).
"""

from __future__ import annotations

import random

import pytest

from bench.detect_sim import Layout, Noise, SimScenario, run_sim
from controller.logic.detection.c4d import C4DConfig, FindingKind, JobTrackers
from controller.logic.detection.c4d.evidence import Normalization, StragglerEvidence
from controller.logic.detection.c4d.peers import JOB_WIDE, PeerBasis, PeerIndex, PeerKey
from trainguard.wire import JobRecords, StepSummary

PP = Layout(kind="pp", world=16, pp=4)  # 4 stages x 4 data-parallel replicas
MOE = Layout(kind="moe", world=16)


# ---------------------------------------------------------------- 1. peers by role


def test_peer_keys_follow_role_and_group_ranks() -> None:
    index = PeerIndex()

    def key(rank: int, **kw: object) -> PeerKey:
        s = StepSummary(
            job="j",
            rank=rank,
            world_size=16,
            step=0,
            step_time_s=1.0,
            compute_time_s=1.0,
            collective_wait_s=0.0,
            **kw,
        )
        return index.key(s)

    assert key(0) == JOB_WIDE and JOB_WIDE.basis is PeerBasis.JOB
    stage = key(5, role="pp_stage=1", pp_stage=1, group_ranks=[7, 4, 5, 6])
    assert stage == PeerKey("pp_stage=1", (4, 5, 6, 7)) and stage.basis is PeerBasis.GROUP_RANKS
    assert stage == key(6, role="pp_stage=1", group_ranks=[4, 5, 6, 7])
    assert stage != key(9, role="pp_stage=2", group_ranks=[8, 9, 10, 11])
    assert key(3, role="expert").basis is PeerBasis.ROLE
    # A rank that declares a role later moves to the new group (cache invalidated).
    assert key(0, role="expert") == PeerKey("expert", ())
    assert stage.label() == "role=pp_stage=1,ranks=[4..7]"


def test_pipeline_with_a_30pct_slower_last_stage_runs_2000_steps_without_an_incident() -> None:
    out = run_sim(SimScenario(name="pp", layout=PP, steps=2000), seed=21)
    assert out.steps == 2000
    assert out.opened == []


def test_comparing_every_rank_with_every_other_would_blame_the_last_stage() -> None:
    """The same job without role fields: the last stage's four ranks look slow. This is
    what grouping by role prevents (and why the job must report roles)."""
    no_roles = Layout(kind="pp", world=16, pp=4, declare_roles=False)
    out = run_sim(SimScenario(name="pp-no-roles", layout=no_roles, steps=200), seed=21)
    assert sorted(rank for _, rank in out.stragglers()) == [12, 13, 14, 15]


def test_moe_with_2x_skewed_all_to_all_runs_2000_steps_without_an_incident() -> None:
    out = run_sim(SimScenario(name="moe", layout=MOE, steps=2000), seed=22)
    assert out.opened == []
    # The popular experts really compute longer: a per-rank threshold calls them slow.
    assert out.baseline_opened


def test_moe_without_bytes_the_popular_expert_is_blamed() -> None:
    """Normalization by bytes moved is what keeps the busy expert from being a straggler."""
    blind = Layout(kind="moe", world=16, report_bytes=False)
    out = run_sim(SimScenario(name="moe-no-bytes", layout=blind, steps=300), seed=22)
    assert out.stragglers()


def test_a_middle_stage_rank_slowed_15pct_is_named_within_50_steps_with_its_stage() -> None:
    sc = SimScenario(name="pp-mid", layout=PP, slow={6: 0.15}, steps=200, fault_step=60)
    out = run_sim(sc, seed=23)
    ((step, rank),) = out.stragglers()
    assert rank == 6 and step - sc.fault_step <= 50
    assert [f.kind for _, f in out.opened] == [FindingKind.STRAGGLER]
    ev = StragglerEvidence.model_validate(out.straggler_updates[0].evidence)
    assert ev.peer_group.ranks == [4, 5, 6, 7] and ev.peer_group.basis is PeerBasis.GROUP_RANKS
    assert "pipeline stage 1" in ev.peer_group.why


def test_a_straggler_among_skewed_experts_is_still_found() -> None:
    sc = SimScenario(name="moe-slow", layout=MOE, slow={9: 0.2}, steps=200, fault_step=60)
    out = run_sim(sc, seed=24)
    assert [rank for _, rank in out.stragglers()] == [9]
    ev = StragglerEvidence.model_validate(out.straggler_updates[0].evidence)
    assert ev.normalization is Normalization.BYTES and ev.bytes_moved is not None


# ---------------------------------------------------------------- 2. heavy-tailed noise


def test_heavy_tailed_spikes_on_random_ranks_raise_nothing() -> None:
    noisy = Noise(jitter=0.1, spike_p=0.02, spike_alpha=1.5)
    out = run_sim(SimScenario(name="heavy", layout=Layout(world=32), noise=noisy, steps=2000), 25)
    assert out.opened == []


def test_a_real_straggler_still_stands_out_of_heavy_tailed_noise() -> None:
    noisy = Noise(jitter=0.1, spike_p=0.02, spike_alpha=1.5)
    sc = SimScenario(name="heavy-slow", layout=Layout(world=32), noise=noisy, slow={11: 0.2})
    out = run_sim(sc, seed=26)
    assert [(f.kind, f.ranks) for _, f in out.opened] == [(FindingKind.STRAGGLER, (11,))]


# ---------------------------------------------------------------- 3. flapping


def test_a_flapping_node_is_one_open_incident_with_its_flaps_counted() -> None:
    sc = SimScenario(name="flap", flap={5: (0.25, 30, 30)}, steps=700)
    out = run_sim(sc, seed=27)
    assert out.stragglers() == [(out.stragglers()[0][0], 5)]
    assert [f.kind for _, f in out.opened] == [FindingKind.STRAGGLER]
    flaps = [StragglerEvidence.model_validate(f.evidence).flaps for f in out.straggler_updates]
    assert flaps == sorted(flaps) and flaps[-1] >= 5  # ~10 slow phases after the first
    assert "flapped" in out.straggler_updates[-1].summary
    # The plain threshold detector opens one incident per slow phase.
    assert len(out.baseline_opened) >= 5


# ---------------------------------------------------------------- 4. many culprits


@pytest.mark.parametrize(
    ("world", "slow"),
    [
        (32, {3: 0.10, 9: 0.15, 17: 0.25, 30: 0.40}),
        (64, {1: 0.12, 14: 0.2, 15: 0.2, 33: 0.3, 47: 0.5, 62: 0.15}),
        (64, dict.fromkeys(range(16, 24), 0.2)),  # a whole slow node: its 8 ranks
    ],
    ids=["32-ranks-4-culprits", "64-ranks-6-culprits", "64-ranks-one-slow-node"],
)
def test_several_culprits_in_a_large_job_are_named_one_by_one(
    world: int, slow: dict[int, float]
) -> None:
    sc = SimScenario(name="multi", layout=Layout(world=world, per_node=8), slow=slow, steps=160)
    out = run_sim(sc, seed=28)
    assert all(f.kind is FindingKind.STRAGGLER and len(f.ranks) == 1 for _, f in out.opened)
    assert sorted(rank for _, rank in out.stragglers()) == sorted(slow)


# ---------------------------------------------------------------- 5. late, out of order


def _rows(step: int, world: int, slow: dict[int, float], rng: random.Random) -> list[StepSummary]:
    compute = {r: (1 + slow.get(r, 0.0)) * (1 + rng.uniform(-0.05, 0.05)) for r in range(world)}
    top = max(compute.values())
    return [
        StepSummary(
            job="late",
            rank=r,
            world_size=world,
            step=step,
            step_time_s=top + 0.1,
            compute_time_s=c,
            collective_wait_s=top - c + 0.1,
        )
        for r, c in compute.items()
    ]


def test_a_node_reporting_seconds_later_in_its_own_batches_loses_no_step() -> None:
    """Node 3 (ranks 12-15, one of them slow) batches 7 steps at a time, ~7 s behind the
    others, which report every step. Every step is still compared whole, in order."""
    trackers = JobTrackers()
    rng = random.Random(5)
    held: list[StepSummary] = []
    found = []
    for step in range(120):
        now = float(step)
        rows = _rows(step, 16, {13: 0.2}, rng)
        for node in range(3):
            trackers.observe(f"n{node}", JobRecords(steps=rows[node * 4 : node * 4 + 4]), now)
        held += rows[12:]
        if step % 7 == 6:
            trackers.observe("n3", JobRecords(steps=held), now + 0.5)
            held = []
        found += trackers.evaluate(now + 0.9)
    tracker = trackers.jobs["late"]
    assert tracker.stragglers.steps_seen >= 112  # none dropped (the last batch may wait)
    assert [(f.kind, f.ranks) for f in found if not f.refresh] == [(FindingKind.STRAGGLER, (13,))]


def test_a_later_step_arriving_first_waits_and_steps_are_compared_in_order() -> None:
    trackers = JobTrackers()
    rng = random.Random(6)
    rows = {step: _rows(step, 4, {}, rng) for step in range(3)}
    trackers.observe("a", JobRecords(steps=rows[1][:2] + rows[2][:2] + rows[0][:2]), 0.0)
    trackers.evaluate(1.0)
    tracker = trackers.jobs["late"]
    assert tracker.last_compared_step == -1  # nothing complete yet: all wait
    trackers.observe("b", JobRecords(steps=rows[2][2:] + rows[0][2:]), 2.0)
    trackers.evaluate(2.0)
    assert tracker.last_compared_step == 0  # step 2 is complete but waits behind step 1
    trackers.observe("b", JobRecords(steps=rows[1][2:]), 3.0)
    trackers.evaluate(3.0)
    assert tracker.last_compared_step == 2 and tracker.stragglers.steps_seen == 3


def test_a_step_missing_a_node_waits_its_bounded_time_then_is_compared() -> None:
    trackers = JobTrackers(C4DConfig(step_wait_s=12.0, min_step_coverage=0.5))
    rows = _rows(0, 4, {}, random.Random(7))
    trackers.observe("a", JobRecords(steps=rows[:3]), 100.0)
    trackers.evaluate(111.0)
    assert trackers.jobs["late"].last_compared_step == -1
    trackers.evaluate(112.0)
    assert trackers.jobs["late"].last_compared_step == 0


def test_waiting_steps_are_bounded_by_count_and_by_records() -> None:
    """A node that never reports its ranks' summaries must not make memory grow: beyond
    the bounds the oldest waiting steps are compared (or dropped) early."""
    rng = random.Random(8)
    for cfg in (
        C4DConfig(max_pending_steps=5, min_step_coverage=0.5),
        C4DConfig(max_pending_records=15, min_step_coverage=0.5),
    ):
        trackers = JobTrackers(cfg)
        for step in range(20):
            trackers.observe("a", JobRecords(steps=_rows(step, 4, {}, rng)[:3]), 0.0)
            trackers.evaluate(0.0)
        tracker = trackers.jobs["late"]
        assert len(tracker.pending_steps) <= 5
        assert tracker.stragglers.steps_seen >= 15


def test_a_hang_stays_one_incident_on_the_same_culprit_when_a_waiting_node_goes_quiet() -> None:
    sc = SimScenario(name="hang-quiet", layout=Layout(world=16), hang=(6, 2))
    out = run_sim(sc, seed=29)
    assert [(f.kind, f.ranks) for _, f in out.opened] == [(FindingKind.HANG, (6,))]


# ---------------------------------------------------------------- 6. evidence


def test_straggler_evidence_shows_times_against_peers_and_why_they_are_peers() -> None:
    sc = SimScenario(name="ev", layout=Layout(world=16), slow={2: 0.3}, steps=120)
    first = run_sim(sc, seed=30).straggler_updates[0]
    ev = StragglerEvidence.model_validate(first.evidence.as_json())
    assert ev.model_dump(mode="json") == first.evidence.as_json()  # typed, and the JSON holds
    assert (ev.rank, ev.node, ev.gpu_index) == (2, "node-0", 2)
    assert ev.peer_group.basis is PeerBasis.JOB and ev.peer_group.ranks == list(range(16))
    assert "data parallel" in ev.peer_group.why
    assert ev.normalization is Normalization.PEER_MEDIAN and ev.bytes_moved is None
    assert ev.compute_s.culprit.median > 1.2 * ev.compute_s.peers.median
    assert ev.collective_wait_s.culprit.median < ev.collective_wait_s.peers.median
    assert ev.compute_s.culprit.steps == ev.window_steps == 20
    assert ev.compute_s.peers.steps == 15 * 20
    assert ev.compute_s.peers.spread > 0
    assert 20 <= ev.slowdown_pct <= 40 and ev.flagged_steps >= 3 and ev.flaps == 0
    assert "15 peers" in ev.verdict
