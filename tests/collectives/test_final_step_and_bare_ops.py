"""The job's last step under device timing, and bare functional operators dropped unwaited.

On a one-rank gloo group in this process. The device marks of a step are stood in for by
marks the test fires by hand (``_Mark``): a GPU's end event that has not fired when the job
ends, without a GPU. Watchdog ticks are called directly, never waited for.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import collectives

pytestmark = pytest.mark.usefixtures("single_rank")

ops = torch.ops._c10d_functional


class _Mark:
    """A device mark that fires when the test says so."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def seconds_since(self, start: Any) -> float:
        return 0.001


def _session(**overrides: Any) -> Any:
    # torch's first functional call builds its wrapping op (slow): before instrumenting.
    funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    overrides.setdefault("watchdog_interval_s", 600.0)  # ticks only where the test calls one
    return collectives.instrument("unit", **overrides)


def _device_timed_call(session: Any) -> _Mark:
    """One collective in the step in progress, timed by a mark that has not fired yet."""
    rec = session.recorder
    call = rec.enter("all_reduce", "g", 16, "float32", True, 0.0)
    end = _Mark()
    call.events = (_Mark(), end)
    rec.event_launched(call, 0.0)
    return end


def test_the_last_hooked_step_timed_on_the_device_goes_out_at_uninstrument() -> None:
    """Step 11 ended at the last optimizer.step() but its device marks fired only after:
    closing the session sends it (the poller is stopped). The tail opened by that last
    optimizer.step() (step 12: no optimizer step of its own) is not sent."""
    session = _session()
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    remove = collectives.hook_optimizer(opt, start_step=10)
    marks: list[_Mark] = []
    for _ in range(3):  # the first call precedes any step; steps 10 and 11 hold one each
        param.grad = torch.ones(2)
        marks.append(_device_timed_call(session))
        opt.step()
    marks[0].fired = marks[1].fired = True
    session.recorder.poll_events()
    assert [s.step for s in session.outbox.steps.items] == [10]
    marks[2].fired = True  # step 11's mark fires after the job's last optimizer.step()
    remove()
    collectives.uninstrument()
    assert [s.step for s in session.outbox.steps.items] == [10, 11]
    assert session.recorder.step == 12  # the tail: left open, not summarized


def test_the_last_step_block_timed_on_the_device_goes_out_at_exit() -> None:
    """The same at process exit (the session's atexit handler), with ``step()`` blocks:
    sent once, not again by a later close."""
    session = _session()
    with collectives.step(0):
        end = _device_timed_call(session)
    assert list(session.outbox.steps.items) == []
    end.fired = True
    session._atexit()
    collectives.uninstrument()
    assert [s.step for s in session.outbox.steps.items] == [0]
    events = [e.kind for e in session.outbox.rank_events.items]
    assert events[-1] == "exited"


def test_a_dropped_bare_op_output_stops_counting_and_a_held_one_does_not() -> None:
    session = _session()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    recorder = session.recorder
    out = ops.all_reduce(torch.ones(3), "sum", name)
    kept = ops.all_reduce(torch.ones(3), "sum", name)
    view = kept[:1]
    del kept  # a view of it is held: still waitable, still in flight
    session.watchdog.tick()
    assert sorted(r.seq for r in recorder._inflight.values()) == [1, 2]
    del out  # never waited: torch's Work keeps the tensor, the job does not
    session.watchdog.tick()
    assert [r.seq for r in recorder._inflight.values()] == [2]
    buf = torch.ones(2)
    ops.all_reduce_(buf, "sum", name)  # in place: the job holds the buffer itself
    session.watchdog.tick()
    assert sorted(r.seq for r in recorder._inflight.values()) == [2, 3]
    del buf
    session.watchdog.tick()
    assert [r.seq for r in recorder._inflight.values()] == [2]
    ops.wait_tensor(view)
    assert recorder._inflight == {}
    assert [r.seq for r in recorder.history] == [2]


def test_an_output_thought_dropped_is_in_flight_again_while_it_is_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """C++ code (inductor's C++ wrapper) holds an output with no Python reference, then
    waits it: the wait brings the abandoned call back, so a stuck wait would show."""
    session = _session()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    recorder = session.recorder
    out = ops.all_reduce(torch.ones(3), "sum", name)
    ref = weakref.ref(out)
    del out
    session.watchdog.tick()
    assert recorder._inflight == {}
    seen: list[list[int]] = []
    unblocked = recorder.unblocked

    def spy(t_start: float, t_end: float, rec: Any) -> None:
        seen.append([r.seq for r in recorder._inflight.values()])
        unblocked(t_start, t_end, rec)

    monkeypatch.setattr(recorder, "unblocked", spy)
    tensor = ref()
    assert tensor is not None
    ops.wait_tensor(tensor)
    assert seen == [[1]]  # in flight during the wait
    assert recorder._inflight == {}
    assert [(r.seq, r.ok) for r in recorder.history] == [(1, True)]
