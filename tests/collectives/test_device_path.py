"""The device path (issue 15, items 1 and 3) on a one-rank gloo group.

Calls timed by marks stay in flight until their end mark fires (a poller reads it; the
training thread never waits for it), the host launch time is kept apart, the step summary
waits for its calls and its NaN/Inf flags. Two clocks drive the same code: the real
:class:`CpuEventClock` (marks fire with the Work's future) and a gated clock that fires only
when the test opens it, standing in for a GPU stream that is still busy.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.timing import CpuEventClock, CpuMark, CudaEventClock, Mark

pytestmark = pytest.mark.usefixtures("single_rank")


def _session(**overrides: Any) -> Any:
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    return collectives.instrument("unit", **overrides)


def _until(predicate: Any, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


class GatedMark(CpuMark):
    def __init__(self, clock: GatedClock) -> None:
        super().__init__(time.perf_counter())
        self.clock = clock

    def query(self) -> bool:
        return self.clock.open.is_set()

    def seconds_since(self, start: Mark) -> float:
        assert self.clock.open.is_set(), "read before the mark fired: that would block"
        return super().seconds_since(start) + self.clock.kernel_s


class GatedClock(CpuEventClock):
    """A stream that is busy until the test says otherwise; each kernel takes 40 ms more
    than the host saw."""

    name = "gated"
    kernel_s = 0.04

    def __init__(self) -> None:
        self.open = threading.Event()

    def start(self) -> Mark:
        return GatedMark(self)

    def end_sync(self) -> Mark:
        return GatedMark(self)

    def end_async(self, work: Any) -> Mark | None:
        return GatedMark(self)


def _gated(**overrides: Any) -> tuple[Any, GatedClock]:
    session = _session(**overrides)
    clock = GatedClock()
    session.instrumenter.clock = session.recorder.clock = clock
    session.instrumenter._device_only = False
    return session, clock


def test_calls_stay_in_flight_until_their_end_marks_fire() -> None:
    session, clock = _gated(watchdog_floor_s=0.2, watchdog_repeat_s=5, watchdog_interval_s=0.05)
    rec = session.recorder
    with collectives.step(0):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        # what DDP's comm hook does: NCCL completes this future at enqueue, so it must not
        # close the record
        fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
        fut.wait()
        dist.all_reduce(torch.ones(4), async_op=True)  # handle dropped at once
    time.sleep(0.5)
    # launched, not finished on the "stream": no history, no summary, reported stuck
    assert len(rec.history) == 0 and not session.outbox.steps.items
    assert sorted(x.seq for x in session.outbox.inflight.items) == [1, 2, 3, 4]
    clock.open.set()
    assert _until(lambda: session.outbox.steps.items)
    (summary,) = list(session.outbox.steps.items)
    durations = [r.blocked_s for r in rec.history]
    assert len(durations) == 4 and all(d >= 0.04 for d in durations)
    assert summary.collective_wait_s == pytest.approx(min(sum(durations), summary.step_time_s))
    enqueue = [r.enqueue_s for r in rec.history]
    assert all(0 < e < 0.04 for e in enqueue)
    assert summary.collective_enqueue_s == pytest.approx(sum(enqueue))
    assert summary.collective_calls == 4 and rec._inflight == {}


def test_cpu_event_clock_closes_calls_when_their_work_completes() -> None:
    session = _session(device_path_on_cpu=True)
    rec = session.recorder
    assert isinstance(session.instrumenter.clock, CpuEventClock)
    with collectives.step(0):
        dist.all_reduce(torch.ones(1000))
        work = dist.all_reduce(torch.ones(4), async_op=True)
        dist.broadcast(torch.ones(4), src=0, async_op=True)  # never waited: its future fires
        work.wait()
    assert _until(lambda: session.outbox.steps.items)
    (summary,) = list(session.outbox.steps.items)
    assert [r.op for r in rec.history] == ["all_reduce", "all_reduce", "broadcast"]
    assert all(r.ok and r.events is not None for r in rec.history)
    assert summary.collective_calls == 3 and summary.collective_bytes == 4032
    assert summary.collective_enqueue_s is not None and summary.collective_enqueue_s > 0
    assert summary.collective_wait_s == pytest.approx(
        min(sum(r.blocked_s for r in rec.history), summary.step_time_s)
    )
    assert rec._inflight == {}


def test_device_nan_check_names_the_first_bad_call_after_the_step() -> None:
    session = _session(device_path_on_cpu=True, nonfinite_check_min_bytes=8)
    with collectives.step(0):
        dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.tensor([1.0, float("inf")]))
        dist.all_reduce(torch.full((4,), float("nan"), dtype=torch.bfloat16))
        dist.all_reduce(torch.tensor([float("nan")]))  # 4 bytes: below the size floor
    with collectives.step(1):
        dist.all_reduce(torch.full((4,), 6e4, dtype=torch.float16))  # sums past fp16's max
        dist.reduce_scatter_tensor(torch.zeros(2), torch.tensor([0.0, float("nan")]))
    with collectives.step(2):
        dist.all_reduce(torch.ones(8))
    assert _until(lambda: len(session.outbox.steps.items) == 3)
    first, second, third = list(session.outbox.steps.items)
    group = session.recorder.history[0].group
    assert (first.nonfinite_inputs, first.nonfinite_first_op, first.nonfinite_first_seq) == (
        2,
        "all_reduce",
        2,
    )
    assert first.nonfinite_first_group == group
    assert (second.nonfinite_inputs, second.nonfinite_first_op) == (1, "reduce_scatter_tensor")
    assert second.nonfinite_first_seq == 6
    assert (third.nonfinite_inputs, third.nonfinite_first_seq) == (0, None)


def test_device_nan_check_every_n_steps_skips_the_others() -> None:
    session = _session(device_path_on_cpu=True, nonfinite_every_steps=2)
    for i in range(4):
        with collectives.step(i):
            dist.all_reduce(torch.full((256,), float("nan")))
    assert _until(lambda: len(session.outbox.steps.items) == 4)
    assert [s.nonfinite_inputs for s in session.outbox.steps.items] == [1, 0, 1, 0]


def test_a_step_waits_for_its_nan_flags_copy() -> None:
    session, clock = _gated()
    with collectives.step(0):
        dist.all_reduce(torch.full((256,), float("nan")))
    time.sleep(0.3)
    assert not session.outbox.steps.items  # the flag copy's mark has not fired
    clock.open.set()
    assert _until(lambda: session.outbox.steps.items)
    assert session.outbox.steps.items[0].nonfinite_inputs == 1


def test_blocking_wait_takes_the_end_mark_at_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert CudaEventClock().end_async(object()) is None  # no side-stream wait: it would block
    session, clock = _gated()
    session.recorder.clock.end_async = lambda work: None  # type: ignore[method-assign]
    clock.open.set()
    with collectives.step(0):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        (rec,) = session.recorder._inflight.values()
        assert rec.events[1] is None
        work.wait()
        assert rec.events[1] is not None
    assert _until(lambda: session.outbox.steps.items)


def test_probe_buffers_live_on_the_backend_device() -> None:
    from collectives.probe import probe_device

    assert probe_device("gloo") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert probe_device("nccl").type == expected
