"""Functional collectives whose results are dropped unwaited, on a one-rank gloo group.

torch keeps an unwaited functional collective's output alive in its ``Work`` until a wait
that never comes, so the wrapper watches the ``AsyncCollectiveTensor`` the job holds: once
it is gone the call stops counting as in flight (else every rank that drops one would
report it stuck forever: a false communication hang). A result still held is reported.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import collectives

pytestmark = pytest.mark.usefixtures("single_rank")

ops = torch.ops._c10d_functional


def _session() -> Any:
    # torch's first functional call builds its wrapping op (most of a second on this box):
    # done before instrumenting, lest the watchdog rightly see that first call in flight.
    funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()
    return collectives.instrument(
        "unit",
        agent_socket="/nonexistent/trainguard.sock",
        watchdog_floor_s=0.2,
        watchdog_repeat_s=0.1,
        watchdog_interval_s=0.05,
    )


def _reported(session: Any) -> list[tuple[str, int]]:
    return [(x.op, x.seq) for x in session.outbox.inflight.items]


def test_a_dropped_result_is_not_a_hang_and_a_held_one_is_reported() -> None:
    session = _session()
    group = dist.group.WORLD
    dropped = funcol.all_reduce(torch.ones(4), "sum", group)
    del dropped  # never used: never waited
    held = funcol.all_reduce(torch.ones(4), "sum", group)
    time.sleep(0.6)
    assert _reported(session)  # the held, unwaited result is in flight
    assert set(_reported(session)) == {("all_reduce", 2)}
    assert [r.seq for r in session.recorder._inflight.values()] == [2]
    assert torch.equal(held + 0, torch.ones(4))  # first use waits it
    assert session.recorder._inflight == {}
    assert [r.seq for r in session.recorder.history] == [2]


def test_a_dropped_result_is_settled_at_the_next_call_without_the_watchdog() -> None:
    session = _session()
    session.watchdog.stop()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    act = funcol.all_gather_tensor(torch.ones(2), 0, dist.group.WORLD)
    del act
    out = ops.all_reduce(torch.ones(3), "sum", name)  # the next call settles the dropped one
    assert [r.seq for r in session.recorder._inflight.values()] == [2]
    ops.wait_tensor(out)
    assert session.recorder._inflight == {}


def test_two_in_place_calls_on_one_buffer_are_both_waited_by_one_wait() -> None:
    session = _session()
    session.watchdog.stop()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    buf = torch.ones(4)
    ops.all_reduce_(buf, "sum", name)
    ops.all_reduce_(buf, "sum", name)
    assert len(session.recorder._inflight) == 2
    ops.wait_tensor(buf)  # torch waits every call registered on the storage
    assert session.recorder._inflight == {}
    assert [r.seq for r in session.recorder.history] == [1, 2]


def test_empty_outputs_sharing_address_zero_are_told_apart() -> None:
    session = _session()
    session.watchdog.stop()
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    first = ops.all_reduce(torch.ones(0), "sum", name)
    second = ops.all_reduce(torch.ones(0), "sum", name)
    assert first.data_ptr() == second.data_ptr()
    ops.wait_tensor(second)
    assert [r.seq for r in session.recorder._inflight.values()] == [1]  # still unwaited
    ops.wait_tensor(first)
    assert session.recorder._inflight == {}
    assert sorted(r.seq for r in session.recorder.history) == [1, 2]


def test_uninstrument_gives_async_collective_tensor_its_own_constructor_back() -> None:
    original = funcol.AsyncCollectiveTensor.__dict__["__new__"]
    _session()
    assert funcol.AsyncCollectiveTensor.__dict__["__new__"] is not original
    collectives.uninstrument()
    assert funcol.AsyncCollectiveTensor.__dict__["__new__"] is original
    assert torch.equal(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD) + 0, torch.ones(2))


def test_a_torch_without_the_expected_constructor_still_instruments(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another torch's AsyncCollectiveTensor (no ``__new__`` of its own): the job's
    instrument() must not fail for it; dropped results then wait for their wait, as before."""
    import collectives.functional as functional

    class Other(torch.Tensor):
        pass

    monkeypatch.setattr(functional, "_async_tensor_class", lambda: Other)
    session = _session()
    assert "dropped functional results not tracked" in caplog.text
    held = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    assert torch.equal(held + 0, torch.ones(2))
    assert session.recorder._inflight == {}
