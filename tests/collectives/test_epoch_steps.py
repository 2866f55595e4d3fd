"""Step numbers that go back inside one process (an epoch loop's count, a retried step) are
carried on, not sent as a restart; a new process, and ``rewind=True``, still go back.

The acceptance probe fed a 16-rank job whose loop restarts its count every 150 steps to the
controller: every epoch read as a job restart (a straggler's incident resolved "job
restarted" and opened again, every window emptied), and without ``end_unix_s`` every step
after the first epoch was dropped. The fix is on the rank, where it is known that no new
process started: :class:`collectives.recorder.StepNumbering`.

Run as a script, this file is the rank worker of the multi-process tests below.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.recorder import STEP_MAX, StepNumbering
from controller.logic.detection.c4d import FindingKind, JobTrackers
from trainguard.wire import JobCheckpoint, JobLinkProbe, JobRecords, StepSummary


def _session(**overrides: Any) -> Any:
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    return collectives.instrument("unit", **overrides)


def _sent(session: Any) -> list[int]:
    return [s.step for s in session.outbox.steps.items]


# ---------------------------------------------------------------------- one rank, in process


@pytest.mark.usefixtures("single_rank")
def test_an_epoch_loop_count_goes_on_being_counted_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = _session()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        for _epoch in range(3):
            for i in range(4):
                with collectives.step(i):
                    dist.all_reduce(torch.ones(2))
    assert _sent(session) == list(range(12))
    # what the recorder tagged the calls with is the number sent, too (in-flight reports)
    assert [r.step for r in session.recorder.history] == list(range(12))
    warned = [r.getMessage() for r in caplog.records if "goes back" in r.getMessage()]
    assert len(warned) == 1
    assert "step 0 follows step 3" in warned[0] and "sent as step 4" in warned[0]
    assert "rewind=True" in warned[0]


@pytest.mark.usefixtures("single_rank")
def test_numbers_that_increase_are_sent_as_given_and_gaps_survive_a_step_back() -> None:
    session = _session()
    for i in (0, 2, 4, 1, 3, 10):
        with collectives.step(i):
            pass
    # 0, 2, 4 as given; 1 goes back: last sent + 1 = 5; then spacing kept (3 -> 7, 10 -> 14)
    assert _sent(session) == [0, 2, 4, 5, 7, 14]


@pytest.mark.usefixtures("single_rank")
def test_a_repeated_number_is_a_new_step_but_a_step_that_raised_gives_its_number_back() -> None:
    session = _session()
    with collectives.step(0):
        pass
    with collectives.step(1):
        pass
    with pytest.raises(RuntimeError), collectives.step(2):
        raise RuntimeError("out of memory; retried")
    with collectives.step(2):  # the retry keeps its number: nothing was sent for the first try
        pass
    with collectives.step(2):  # the same number again, after a step that ended: a new step
        pass
    assert _sent(session) == [0, 1, 2, 3]


@pytest.mark.usefixtures("single_rank")
def test_rewind_sends_the_loop_numbers_again_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An in-process rollback (checkpoint 4 reloaded after step 7) stays visible as steps run
    again, in the checkpoints' numbering, as a restarted process would send them."""
    session = _session()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        for i in range(8):
            with collectives.step(i):
                pass
        for i in range(5, 8):
            with collectives.step(i, rewind=i == 5):
                pass
    assert _sent(session) == [*range(8), 5, 6, 7]
    assert not [r for r in caplog.records if "goes back" in r.getMessage()]


@pytest.mark.usefixtures("single_rank")
def test_a_number_carried_past_what_a_summary_holds_is_refused_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = _session()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        with collectives.step(STEP_MAX):
            pass
        with collectives.step(0):  # would be sent as STEP_MAX + 1: no step, training goes on
            dist.all_reduce(torch.ones(1))
    assert _sent(session) == [STEP_MAX]
    assert session.recorder.history[-1].step is None
    (warned,) = [r.getMessage() for r in caplog.records if "cannot be sent" in r.getMessage()]
    assert "step number 0 follows step" in warned


@pytest.mark.usefixtures("single_rank")
def test_a_step_number_above_the_wire_limit_is_refused_not_raised_at_the_blocks_end() -> None:
    """The wire carries steps up to 10**12 (``trainguard.wire.MAX_STEP``); the rank took up
    to 2**63-1, and a summary above the limit failed to build inside the ``with`` block's
    exit: a ValidationError out of the training loop."""
    session = _session()
    for number in (STEP_MAX + 1, 1 << 62):
        with collectives.step(number):
            dist.all_reduce(torch.ones(1))
    assert _sent(session) == []


@pytest.mark.usefixtures("single_rank")
def test_commands_name_steps_in_the_numbering_sent() -> None:
    session = _session()
    session.control.handle(
        [
            JobCheckpoint(id="c", job="unit", at_step=6),
            JobLinkProbe(id="p", job="unit", at_step=9, pairs=[(0, 5)], size_bytes=8),
        ]
    )
    asked: list[tuple[int, int]] = []
    for epoch in range(3):
        for i in range(4):
            with collectives.step(i):
                pass
            if collectives.should_checkpoint(i):
                asked.append((epoch, i))
    assert asked == [(1, 2)]  # sent step 6 is epoch 1's i=2
    (probe,) = session.outbox.probes.items  # ran at the start of sent step 9 (epoch 2, i=1)
    assert "outside the job" in probe.error  # not "after at_step": it was on time
    # checkpoint_vote asks in the same numbering
    session.control.handle([JobCheckpoint(id="v", job="unit", at_step=11, request=3)])
    assert collectives.checkpoint_vote(2) == 0  # epoch 2's i=2 is sent step 10
    assert collectives.checkpoint_vote(3) == 3  # i=3 is step 11


@pytest.mark.usefixtures("single_rank")
def test_checkpoint_callbacks_fire_at_the_sent_step_with_the_loops_number() -> None:
    session = _session()
    seen: list[int] = []
    collectives.on_checkpoint(seen.append)
    session.control.handle([JobCheckpoint(id="cb", job="unit", at_step=6)])
    for _epoch in range(3):
        for i in range(4):
            with collectives.step(i):
                pass
    assert seen == [2]  # sent step 6 is epoch 1's i=2: the loop saves under its own 2


@pytest.mark.usefixtures("single_rank")
def test_a_new_session_numbers_afresh_and_says_started() -> None:
    """A restart is a new process: its numbering starts over, and its ``started`` event is
    what tells the controller (the numbers going back then read as a restart)."""
    first = _session()
    for _epoch in range(2):
        for i in range(3):
            with collectives.step(i):
                pass
    assert _sent(first) == list(range(6))
    collectives.uninstrument()
    second = _session()
    for i in range(2, 4):
        with collectives.step(i):
            pass
    assert _sent(second) == [2, 3]
    assert [e.kind for e in second.outbox.rank_events.items][:1] == ["started"]


# ---------------------------------------------------------------------- the controller's view


def _summaries(
    world: int, iteration: int, step: int, slow: dict[int, float], rng: random.Random, clock: bool
) -> dict[str, list[StepSummary]]:
    """One synchronous step: every rank waits for the slowest (as in the probe)."""
    compute = {r: slow.get(r, 1.0) * (1 + rng.uniform(-0.05, 0.05)) for r in range(world)}
    total = max(compute.values()) + 0.1
    by_node: dict[str, list[StepSummary]] = {}
    for r, c in compute.items():
        summary = StepSummary(
            job="je",
            rank=r,
            world_size=world,
            step=step,
            step_time_s=total,
            compute_time_s=c,
            collective_wait_s=total - c,
            gpu_index=r % 4,
            end_unix_s=1.7e9 + iteration * 1.3 if clock else None,
        )
        by_node.setdefault(f"n{r // 4}", []).append(summary)
    return by_node


def _aligned(numbering: list[StepNumbering], given: int) -> int:
    """Every rank's session numbers the loop's step ``given``; they agree on what is sent."""
    sent = set()
    for n in numbering:
        step, _ = n.open(given)
        n.close()
        sent.add(step)
    (step,) = sent
    assert step is not None
    return step


@pytest.mark.parametrize("clock", [True, False], ids=["end_unix_s", "older-agent"])
def test_the_probe_job_keeps_one_straggler_incident_across_epochs(clock: bool) -> None:
    """The probe's job (16 ranks, count reset every 150 steps, rank 3 1.2x slow), numbered
    as each rank's session numbers it: one incident that stays open, no restart."""
    world, rng, trackers = 16, random.Random(1), JobTrackers()
    numbering = [StepNumbering() for _ in range(world)]
    findings = []
    now = 0.0
    for it in range(600):
        step = _aligned(numbering, it % 150)
        assert step == it
        for node, rows in _summaries(world, it, step, {3: 1.2}, rng, clock).items():
            trackers.observe(node, JobRecords(steps=rows), now)
        findings += [f for f in trackers.evaluate(now) if not f.refresh]
        now += 1.3
    assert trackers.jobs["je"].incarnation == 0
    assert [(f.kind, f.resolved, f.ranks) for f in findings] == [
        (FindingKind.STRAGGLER, False, (3,))
    ]


def test_a_recovered_straggler_resolves_and_a_new_one_opens_across_epochs() -> None:
    """The probe's second job (no ``end_unix_s``): rank 3 slow in epoch 1, rank 9 after.
    Before, every step after epoch 1 was dropped: rank 3 stayed open, rank 9 never opened."""
    world, rng, trackers = 16, random.Random(1), JobTrackers()
    numbering = [StepNumbering() for _ in range(world)]
    findings = []
    now = 0.0
    for it in range(600):
        step = _aligned(numbering, it % 150)
        slow = {3: 1.2} if it < 150 else {9: 1.3}
        for node, rows in _summaries(world, it, step, slow, rng, clock=False).items():
            trackers.observe(node, JobRecords(steps=rows), now)
        findings += [(f.ranks, f.resolved) for f in trackers.evaluate(now) if not f.refresh]
        now += 1.3
    assert findings == [((3,), False), ((9,), False), ((3,), True)]


# ---------------------------------------------------------------------- real ranks (gloo)


def _wait_for(check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def _worker() -> None:
    """One rank: epochs of 5 steps (``i`` from 0 each epoch), then what it saw to JSON."""
    out = Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=rank, world_size=world
    )
    session = collectives.instrument()
    if os.environ.get("TG_WAIT_COMMANDS"):
        # Every rank holds the probe and the checkpoint request before the loop starts, so
        # the test does not depend on when the agent's reply comes.
        ok = _wait_for(lambda: "p1" in session.control._probes and session.control._checkpoints, 30)
        assert ok, "the commands never arrived"
    dist.barrier()
    saved = []
    first = int(os.environ.get("TG_FIRST_EPOCH", "0"))
    for epoch in range(first, 3):
        for i in range(5):
            with collectives.step(i):
                dist.all_reduce(torch.ones(8))
            if collectives.should_checkpoint(i):
                saved.append([epoch, i])
    session.client.flush(5.0)
    (out / f"rank{rank}.json").write_text(json.dumps({"saved": saved}))
    dist.barrier()
    dist.destroy_process_group()


def _run(launcher: Any, out: Path, agent: Any, env: dict[str, str]) -> list[dict[str, Any]]:
    ranks = launcher(
        "epochs", 2, out, socket_path=agent.path, env=env, worker=Path(__file__).resolve()
    )
    try:
        codes = ranks.wait(120)
        assert codes == [0, 0], "\n".join(ranks.stderr(r)[-3000:] for r in range(2))
    finally:
        ranks.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_real_ranks_in_an_epoch_loop_stay_aligned_and_only_a_new_process_restarts(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    agent = collectives_agent
    agent.commands = [
        (-1, JobLinkProbe(id="p1", job="test-job", at_step=7, pairs=[(0, 1)], size_bytes=4096)),
        (-1, JobCheckpoint(id="c1", job="test-job", at_step=12, request=1)),
    ]
    first = _run(rank_launcher, tmp_path / "run1", agent, {"TG_WAIT_COMMANDS": "1"})
    # The request for sent step 12 is epoch 2's i=2 on both ranks; the probe for step 7
    # (epoch 1, i=2) ran on both, in time.
    assert [r["saved"] for r in first] == [[[2, 2]], [[2, 2]]]
    (probe,) = agent.probes()
    assert probe.ok and probe.probe_id == "p1" and (probe.src_rank, probe.dst_rank) == (0, 1)
    run1 = agent.steps()
    assert set(run1) == {(r, s) for r in range(2) for s in range(15)}

    exited = agent.wait_for(lambda: [e for e in agent.events() if e.kind == "exited"], 10)
    assert sorted(e.rank for e in exited) == [0, 1]  # run 1 is all in before run 2 starts
    batches = len(agent.records())
    # A real restart: new processes, resumed at epoch 2, count from its i=0 again.
    _run(rank_launcher, tmp_path / "run2", agent, {"TG_FIRST_EPOCH": "2"})
    run2 = [s for _, b in agent.records()[batches:] for s in b.steps]
    assert sorted((s.rank, s.step) for s in run2) == [(r, s) for r in range(2) for s in range(5)]

    # The controller, fed what reached the agent in order: one run of 15 steps, compared
    # in full, then one restart (the new processes' ``started``), not one per epoch.
    # One controller instant for all (no step is compared before both ranks' summaries are
    # in, however the batches were cut).
    trackers = JobTrackers()
    tracker = trackers.tracker("test-job")
    for n, (rank, records) in enumerate(agent.records()):
        trackers.observe(f"node{rank}", records, 0.0)
        trackers.evaluate(0.0)
        if n == batches - 1:
            assert (tracker.incarnation, tracker.last_compared_step) == (0, 14)
    assert (tracker.incarnation, tracker.last_compared_step) == (1, 4)


if __name__ == "__main__":
    _worker()
