"""Coalescing blocks (``torch.distributed._coalescing_manager``) recorded and timed as one
collective, on a one-rank gloo group with Flight Recorder on.

Flight Recorder lists one entry per block; the wrapper must record the same (group, seq,
op), with the sizes of all the block's calls. The device path (``device_path_on_cpu``: the
same code as CUDA events, with CPU marks) must bracket the block with one start mark taken
before its first call and one end mark after its last; before, each call got marks of its
own (on a GPU both recorded before any kernel ran) and an ``async_ops`` block raised on
torch's ``_IllegalWork``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import collectives
from collectives import flight
from collectives.coalesce import Block
from collectives.timing import CpuEventClock, CpuMark, Mark


@pytest.fixture
def fr_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One gloo rank whose process group has Flight Recorder on (set before it exists)."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "200")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'st'}", rank=0, world_size=1)
    try:
        yield
    finally:
        collectives.uninstrument()
        dist.destroy_process_group()


class LoggingClock(CpuEventClock):
    """The CPU stand-in clock, logging each mark it makes (kind, host time)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, CpuMark]] = []

    def start(self) -> Mark:
        mark = CpuMark(time.perf_counter())
        self.log.append(("start", mark))
        return mark

    def end_sync(self) -> Mark:
        mark = CpuMark(time.perf_counter())
        self.log.append(("end", mark))
        return mark

    def end_async(self, work: Any) -> Mark | None:
        mark = super().end_async(work)
        assert isinstance(mark, CpuMark)
        self.log.append(("end", mark))
        return mark


def _session(clock: CpuEventClock | None = None) -> Any:
    session = collectives.instrument(
        "unit", agent_socket="/nonexistent/trainguard.sock", device_path_on_cpu=clock is not None
    )
    if clock is not None:
        session.instrumenter.clock = session.recorder.clock = clock
    return session


def _settled(session: Any) -> list[Any]:
    deadline = time.monotonic() + 5
    while session.recorder._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not session.recorder._inflight
    return [r for r in session.recorder.history if r.step == 0]


def _blocks() -> None:
    with dist._coalescing_manager():
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(8))
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(torch.ones(4), async_op=True)
        dist.all_reduce(torch.ones(8), async_op=True)
    cm.wait()
    out = [torch.empty(2), torch.empty(2)]
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(out[0], torch.ones(2))
        dist.all_gather_into_tensor(out[1], torch.ones(2))


@pytest.mark.usefixtures("fr_rank")
@pytest.mark.parametrize("device_path", [False, True])
def test_a_block_is_the_one_collective_flight_recorder_lists(device_path: bool) -> None:
    session = _session(LoggingClock() if device_path else None)
    t0 = time.time_ns()
    with collectives.step(0):
        _blocks()
    windows = {0: (t0, time.time_ns())}
    calls = _settled(session)
    assert [(c.op, c.size_bytes) for c in calls] == [
        ("all_reduce_coalesced", 48),
        ("all_reduce_coalesced", 48),
        ("all_gather_into_tensor_coalesced", 16),
    ]
    assert all(c.ok and (c.events is not None) == device_path for c in calls)
    names = dict(session.recorder.group_names)
    ours = [flight.Call(c.step, names.get(c.group, c.group), c.seq, c.op) for c in calls]
    cmp = flight.compare(ours, flight.dump()["entries"], windows)
    assert cmp.listed == 3 and cmp.missing == [] and cmp.ratio == 1.0
    (summary,) = list(session.outbox.steps.items)
    assert summary.collective_calls == 3 and summary.collective_bytes == 112


@pytest.mark.usefixtures("fr_rank")
def test_device_marks_bracket_the_whole_block() -> None:
    clock = LoggingClock()
    session = _session(clock)
    with collectives.step(0):
        with dist._coalescing_manager(async_ops=True) as cm:
            before_first = time.perf_counter()
            dist.all_reduce(torch.ones(4), async_op=True)
            dist.all_reduce(torch.ones(8), async_op=True)
            after_last = time.perf_counter()
        cm.wait()
    (rec,) = _settled(session)
    assert [kind for kind, _ in clock.log] == ["start", "end"]  # one pair for the block
    (_, start), (_, end) = clock.log
    assert rec.events == (start, end)
    assert start.t is not None and end.t is not None
    assert start.t <= before_first and end.t >= after_last
    assert rec.blocked_s >= end.seconds_since(start) > 0  # the poller read the marks


@pytest.mark.usefixtures("fr_rank")
def test_calls_queued_in_a_device_mode_block_take_the_blocks_marks() -> None:
    """ProcessGroupNCCL queues every call of a ``device=`` block in one NCCL group launched
    at the block's end; gloo has no such mode, so the block is opened as one here (the
    calls then run at once, which the marks do not depend on)."""
    clock = LoggingClock()
    session = _session(clock)
    inst = session.instrumenter
    original = c10d._coalescing_manager.__trainguard_original__
    gid = inst.groups.resolve(None).id
    with collectives.step(0):
        from collectives import wrap

        block = Block(inst, wrap._tls, original(), gid, device=True, async_ops=False)
        with block:
            dist.broadcast(torch.ones(4), 0)
            dist.broadcast(torch.ones(2), 0)
    calls = _settled(session)
    assert [c.op for c in calls] == ["broadcast", "broadcast"]
    assert [kind for kind, _ in clock.log] == ["start", "end"]
    (_, start), (_, end) = clock.log
    assert all(c.events == (start, end) for c in calls)


@pytest.mark.usefixtures("fr_rank")
def test_a_failing_block_fails_its_record_and_unpatch_restores_torch() -> None:
    session = _session()
    original = c10d._coalescing_manager.__trainguard_original__
    with collectives.step(0), contextlib.suppress(RuntimeError), dist._coalescing_manager():
        dist.all_reduce(torch.ones(4))
        dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))  # mixed: torch refuses
    (rec,) = _settled(session)
    assert rec.op == "all_reduce_coalesced" and not rec.ok
    collectives.uninstrument()
    assert c10d._coalescing_manager is original and dist._coalescing_manager is original
