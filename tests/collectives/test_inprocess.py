"""Instrumentation inside this process on a one-rank gloo group: fast checks of the details."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import collectives
from collectives.control import Control
from collectives.recorder import COMPUTE_OP
from collectives.wrap import OPS
from trainguard.wire import InflightCollective, JobCheckpoint, JobLinkProbe, JobStop

pytestmark = pytest.mark.usefixtures("single_rank")


def _session(**overrides: Any) -> Any:
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    return collectives.instrument("unit", **overrides)


def test_uninstrument_restores_every_original_function() -> None:
    before = {name: (getattr(dist, name), getattr(c10d, name)) for name in OPS}
    session = _session()
    for name in OPS:
        assert getattr(dist, name) is getattr(c10d, name) is not before[name][0]
        assert getattr(dist, name).__trainguard_original__ is before[name][0]
    assert collectives.instrument("unit") is session  # idempotent for the same job
    with pytest.raises(collectives.CollectivesConfigError, match="already instrumented"):
        collectives.instrument("other")
    collectives.uninstrument()
    assert {name: (getattr(dist, name), getattr(c10d, name)) for name in OPS} == before
    assert collectives.current() is None
    dist.all_reduce(torch.ones(1))
    assert len(session.recorder.history) == 0
    assert not session.watchdog._thread.is_alive()


def test_async_handles_stay_in_flight_until_waited() -> None:
    session = _session()
    rec = session.recorder
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    assert type(work).__name__ == "TimedWork"
    assert len(rec.history) == 0  # not complete before wait()
    work.wait()
    assert [(r.op, r.seq, r.async_op) for r in rec.history] == [("all_reduce", 1, True)]
    fut = dist.broadcast(torch.ones(2), src=0, async_op=True).get_future()
    fut.wait()
    deadline = time.monotonic() + 5
    while len(rec.history) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.op for r in rec.history] == ["all_reduce", "broadcast"]
    dropped = dist.all_reduce(torch.ones(1), async_op=True)
    time.sleep(0.05)
    del dropped
    gc.collect()
    assert rec._inflight == {}  # an unwaited handle does not linger as a stuck call
    assert rec.last_completed() == {rec.history[0].group: 3}


def test_step_summary_splits_compute_and_wait() -> None:
    session = _session()
    with collectives.step(0):
        time.sleep(0.05)
        dist.all_reduce(torch.ones(1000))
        dist.barrier()
    (summary,) = list(session.outbox.steps.items)
    assert summary.step == 0 and summary.collective_calls == 2
    assert summary.collective_bytes == 4000
    assert summary.compute_time_s >= 0.05
    assert summary.compute_time_s + summary.collective_wait_s == pytest.approx(summary.step_time_s)
    history = list(session.recorder.history)
    assert summary.collective_wait_s >= sum(r.duration_s for r in history) * 0.99
    with pytest.raises(RuntimeError), collectives.step(1):
        dist.all_reduce(torch.ones(1))
        raise RuntimeError("step failed")
    assert len(session.outbox.steps.items) == 1  # a failed step is no step


def test_a_call_stuck_inside_is_reported_while_it_lasts_then_completes() -> None:
    session = _session(
        watchdog_floor_s=0.2,
        watchdog_repeat_s=0.1,
        watchdog_interval_s=0.05,
        report_compute_stalls=True,  # inside a collective, so no compute report anyway
    )
    collectives.add_faults(
        [
            {
                "kind": "hang",
                "rank": 0,
                "at_step": 1,
                "op": "all_reduce",
                "where": "inside",
                "duration_s": 0.8,
            }
        ]
    )
    with collectives.step(0):
        dist.all_reduce(torch.ones(1))
    with collectives.step(1):
        dist.all_reduce(torch.ones(1))
    reports = [x for x in session.outbox.inflight.items if x.op == "all_reduce"]
    assert len(reports) >= 2
    assert {(x.seq, x.step, x.size_bytes) for x in reports} == {(2, 1, 4)}
    assert all(x.last_completed_seq == {reports[0].group: 1} for x in reports)
    assert all(x.group_ranks == [0] for x in reports)
    assert all(x.elapsed_s >= 0.2 for x in reports)
    assert not [x for x in session.outbox.inflight.items if x.op == COMPUTE_OP]
    steps = list(session.outbox.steps.items)
    assert steps[1].collective_wait_s >= 0.8  # the hang was inside the collective


def test_a_thread_stuck_outside_collectives_is_silent_by_default() -> None:
    session = _session(watchdog_floor_s=0.2, watchdog_interval_s=0.05)
    with collectives.step(0):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.5)
    assert list(session.outbox.inflight.items) == []


def test_a_thread_stuck_outside_collectives_reports_compute_when_asked() -> None:
    session = _session(
        watchdog_floor_s=0.2,
        watchdog_repeat_s=5,
        watchdog_interval_s=0.05,
        report_compute_stalls=True,
    )
    with collectives.step(0):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.6)
    reports = list(session.outbox.inflight.items)
    assert len(reports) == 1  # repeat_s=5: reported once while it lasted
    (stall,) = reports
    assert (stall.op, stall.group, stall.seq, stall.step) == (COMPUTE_OP, "", 0, 0)
    assert stall.elapsed_s >= 0.2 and stall.last_completed_seq
    time.sleep(0.3)
    assert len(session.outbox.inflight.items) == 1  # outside a step nothing is "stuck"


def test_watchdog_deadline_follows_the_median_with_a_floor() -> None:
    session = _session(watchdog_floor_s=0.1, watchdog_multiplier=5, watchdog_repeat_s=1)
    session.watchdog.stop()
    rec = session.recorder
    for i in range(5):  # five completed all_reduces of 0.2 s: deadline 5 x 0.2 = 1.0 s
        call = rec.enter("all_reduce", "g", 8, "float32", False, 100.0 + i)
        rec.complete(call, 100.2 + i)
    stuck = rec.enter("all_reduce", "g", 8, "float32", False, 200.0)
    other = rec.enter("broadcast", "g", 8, "float32", False, 200.0)  # no history: the floor
    assert [(x.op, x.seq) for x in rec.stuck(200.5)] == [("broadcast", 7)]
    assert rec.stuck(200.9) == []  # broadcast re-reported only after repeat_s
    found: list[InflightCollective] = rec.stuck(201.6)
    assert sorted((x.op, x.seq) for x in found) == [("all_reduce", 6), ("broadcast", 7)]
    assert all(x.last_completed_seq == {"g": 5} for x in found)
    rec.complete(stuck, 202.0)
    rec.complete(other, 202.0)
    assert rec.stuck(210.0) == []


def test_commands_reach_the_training_loop() -> None:
    session = _session()
    seen: list[int] = []
    collectives.on_checkpoint(seen.append)
    session.control.handle(
        [
            JobCheckpoint(id="c1", job="unit", at_step=2),
            JobCheckpoint(id="c1", job="unit", at_step=0),  # a re-delivered id is ignored
            JobCheckpoint(id="c2", job="someone-else", at_step=1),
            JobLinkProbe(id="odd", job="unit", at_step=1, pairs=[(0, 5)], size_bytes=8),
        ]
    )
    assert not collectives.should_stop()
    for i in range(4):
        with collectives.step(i):
            dist.all_reduce(torch.ones(1))
    assert seen == [2]
    session.control.handle([JobCheckpoint(id="c3", job="unit")])  # no at_step: next boundary
    assert collectives.should_checkpoint(4) and not collectives.should_checkpoint(5)
    session.control.handle([JobStop(id="s", job="unit", reason="operator")])
    assert collectives.should_stop() and session.control.stop_reason == "operator"
    session.control.handle(
        [JobLinkProbe(id="late", job="unit", at_step=2, pairs=[(0, 1)], size_bytes=8)]
    )
    with collectives.step(6):
        pass
    odd, late = list(session.outbox.probes.items)
    assert not odd.ok and "outside the job" in odd.error and odd.dst_rank == 5
    assert not late.ok and "step 6, after at_step 2" in late.error and late.src_rank == 0


def test_one_checkpoint_request_is_one_checkpoint_however_its_copies_arrive() -> None:
    """Two nodes' ranks, as two Controls: node A gets the copy of request 7 at step 11, node
    B at step 12. A loop that agreed only on a flag checkpointed twice (once per copy; one
    per node at scale); agreeing on the number, B's late copy is already answered."""
    a, b = Control("unit"), Control("unit")

    def agree(step: int) -> int:
        vote = max(a.checkpoint_vote(step), b.checkpoint_vote(step))  # the MAX all-reduce
        if vote:
            a.checkpoint_agreed(vote)
            b.checkpoint_agreed(vote)
        return vote

    a.handle([JobCheckpoint(id="copy-a", job="unit", request=7)])
    assert agree(11) == 7  # one checkpoint after step 11
    b.handle([JobCheckpoint(id="copy-b", job="unit", request=7)])  # B's copy, a step late
    b.handle([JobCheckpoint(id="older", job="unit", request=5)])  # older ones too
    assert agree(12) == 0 and agree(13) == 0
    # A copy already held for a later step is dropped once its number is agreed on.
    b.handle([JobCheckpoint(id="b9", job="unit", request=9, at_step=30)])
    a.handle([JobCheckpoint(id="a9", job="unit", request=9)])
    assert agree(14) == 9 and agree(30) == 0
    # The newest request wins the vote and answers the older one held elsewhere.
    a.handle([JobCheckpoint(id="a10", job="unit", request=10)])
    b.handle([JobCheckpoint(id="b11", job="unit", request=11)])
    assert agree(15) == 11 and agree(16) == 0
    # Requests without a number (an older controller) are each their own checkpoint.
    a.handle([JobCheckpoint(id="u1", job="unit")])
    assert agree(17) == 1
    b.handle([JobCheckpoint(id="u2", job="unit")])
    assert agree(18) == 1 and agree(19) == 0
    # The public face on an instrumented rank: the same vote, consumed once.
    session = _session()
    session.control.handle([JobCheckpoint(id="p", job="unit", request=12)])
    assert collectives.checkpoint_vote(20) == 12 and collectives.checkpoint_vote(21) == 0
    collectives.checkpoint_agreed(12)
    session.control.handle([JobCheckpoint(id="p2", job="unit", request=12)])
    assert not collectives.should_checkpoint(22)


def test_optimizer_hook_marks_steps() -> None:
    session = _session()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    remove = collectives.hook_optimizer(opt, start_step=10)
    for _ in range(3):
        loss = model(torch.ones(1, 2)).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # type: ignore[arg-type]
        opt.step()
    remove()
    steps = [(s.step, s.collective_calls) for s in session.outbox.steps.items]
    assert steps == [(10, 2), (11, 2)]  # step k ends at the optimizer.step() after it opened


def test_two_lines_are_harmless_without_instrumentation() -> None:
    collectives.uninstrument()
    with collectives.step(0):
        dist.all_reduce(torch.ones(1))
    assert not collectives.should_stop() and not collectives.should_checkpoint(0)
    with pytest.raises(collectives.NotInstrumentedError):
        collectives.on_checkpoint(lambda step: None)


def test_background_threads_are_daemons() -> None:
    _session()
    names = {t.name: t.daemon for t in threading.enumerate() if t.name.startswith("trainguard")}
    assert names == {"trainguard-ship": True, "trainguard-watchdog": True}


def test_ddp_gradients_are_seen_through_the_standard_allreduce_hook() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    session = _session()
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    )
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        with collectives.step(i):
            loss = model(torch.ones(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    deadline = time.monotonic() + 5
    while len(session.recorder.history) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    grads = (8 * 8 + 8 + 8 + 1) * 4  # one bucket holding every gradient
    assert [(r.op, r.seq, r.size_bytes, r.async_op, r.step) for r in session.recorder.history] == [
        ("all_reduce", 1, grads, True, 0),
        ("all_reduce", 2, grads, True, 1),
    ]
    assert session.recorder._inflight == {}


def test_nonfinite_reduction_inputs_are_counted_before_the_call_spreads_them() -> None:
    session = _session(nonfinite_check_min_bytes=8)
    with collectives.step(0):
        dist.all_reduce(torch.ones(8))
        dist.broadcast(torch.full((4,), float("nan")), src=0)  # not a reduction: unchecked
        dist.all_reduce(torch.tensor([1.0, float("inf")]))
        dist.all_reduce(torch.full((4,), float("nan"), dtype=torch.bfloat16))
        dist.all_reduce(torch.tensor([1, 2]))  # integers cannot be NaN
        dist.all_reduce(torch.tensor([float("nan")]))  # 4 bytes: below the size floor
    with collectives.step(1):
        dist.all_reduce(torch.full((4,), 6e4, dtype=torch.float16))  # sums past fp16's max
        dist.reduce_scatter_tensor(torch.zeros(2), torch.tensor([0.0, float("nan")]))
    dist.all_reduce(torch.full((2,), float("nan")))  # outside a step: no summary to carry it
    first, second = list(session.outbox.steps.items)
    ops = [(r.op, r.seq) for r in session.recorder.history][:3]
    assert ops == [("all_reduce", 1), ("broadcast", 2), ("all_reduce", 3)]
    assert first.nonfinite_inputs == 2
    assert (first.nonfinite_first_op, first.nonfinite_first_seq) == ("all_reduce", 3)
    assert first.nonfinite_first_group == session.recorder.history[0].group
    assert second.nonfinite_inputs == 1
    assert (second.nonfinite_first_op, second.nonfinite_first_seq) == ("reduce_scatter_tensor", 8)


def test_nan_fault_is_seen_on_the_poisoned_rank_and_the_check_can_be_turned_off() -> None:
    session = _session()
    collectives.add_faults([{"kind": "nan", "rank": 0, "at_step": 1, "call": 2}])
    for i in range(3):
        with collectives.step(i):
            dist.all_reduce(torch.ones(256))  # 1 KiB: the default size floor
            dist.all_reduce(torch.ones(256))
    counts = [
        (s.step, s.nonfinite_inputs, s.nonfinite_first_seq) for s in session.outbox.steps.items
    ]
    assert counts == [(0, 0, None), (1, 1, 4), (2, 0, None)]
    collectives.uninstrument()
    session = _session(check_nonfinite=False)
    with collectives.step(0):
        dist.all_reduce(torch.full((256,), float("nan")))
    assert [s.nonfinite_inputs for s in session.outbox.steps.items] == [0]


def test_a_dump_trace_command_is_answered_at_once_and_says_when_fr_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainguard.wire import JobDumpTrace

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    session = _session()
    session.control.handle([JobDumpTrace(id="d1", job="unit"), JobDumpTrace(id="d2", job="x")])
    (record,) = list(session.outbox.traces.items)  # answered on the handling thread
    assert (record.rank, record.command_id, record.enabled) == (0, "d1", False)
    assert "TORCH_FR_BUFFER_SIZE" in record.error
    assert record.pg_ranks == {session.instrumenter.groups.world().name: [0]}


def test_torch_modules_that_imported_a_function_early_call_the_wrapper() -> None:
    from torch.distributed.tensor import _collective_utils  # binds scatter/broadcast by name

    original = _collective_utils.scatter
    session = _session()
    assert _collective_utils.scatter is dist.scatter is not original
    with collectives.step(0):
        _collective_utils.broadcast(torch.ones(4), src=0)
    assert [r.op for r in session.recorder.history] == ["broadcast"]
    collectives.uninstrument()
    assert _collective_utils.scatter is original


def test_the_rank_tells_its_pod_and_namespace_in_hello_and_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Placement on Kubernetes is learned from these (issue 18): downward-API env."""
    monkeypatch.setenv("POD_NAME", "demo-llm-workers-0-1-x7k2p")
    monkeypatch.setenv("POD_NAMESPACE", "train")
    session = _session()
    assert (session.client.hello.pod, session.client.hello.namespace) == (
        "demo-llm-workers-0-1-x7k2p",
        "train",
    )
    started = [e for e in session.outbox.drain().rank_events if e.kind == "started"]
    assert [(e.pod, e.namespace, e.world_size) for e in started] == [
        ("demo-llm-workers-0-1-x7k2p", "train", 1)
    ]
