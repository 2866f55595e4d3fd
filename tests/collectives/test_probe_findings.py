"""Findings of the collectives acceptance probe, each fixed: step numbers a summary cannot
carry, groups this rank is not in, overflowing NaN/Inf sums, nested step blocks."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import collectives

pytestmark = pytest.mark.usefixtures("single_rank")


def _session(**overrides: Any) -> Any:
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    return collectives.instrument("unit", **overrides)


def _steps(session: Any) -> list[Any]:
    return list(session.outbox.steps.items)


def _until(check: Any, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    return check()


@pytest.mark.parametrize("bad", [-1, 5.5, "a", 1 << 63, None])
def test_a_step_number_the_wire_cannot_carry_warns_once_and_never_raises(
    bad: Any, caplog: pytest.LogCaptureFixture
) -> None:
    session = _session()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        for _ in range(3):
            with collectives.step(bad):
                dist.all_reduce(torch.ones(4))
        with collectives.step(7):
            dist.all_reduce(torch.ones(4))
    assert [(s.step, s.collective_calls) for s in _steps(session)] == [(7, 1)]
    warned = [r.getMessage() for r in caplog.records if "step number" in r.getMessage()]
    assert len(warned) == 1 and repr(bad) in warned[0]
    # the refused blocks' calls were made outside any step
    assert [r.step for r in session.recorder.history] == [None, None, None, 7]


def test_an_unsendable_step_number_reaches_no_fault_probe_or_in_flight_report() -> None:
    session = _session(watchdog_floor_s=0.05, watchdog_interval_s=0.02)
    collectives.add_faults([{"kind": "delay", "rank": 0, "from_step": 0, "delay_s": 0.0}])
    with collectives.step(-1):
        dist.all_reduce(torch.ones(4))
        time.sleep(0.2)  # past the stall floor: a compute stall report would carry the step
    assert session.recorder.step is None
    assert all(x.step is None for x in session.outbox.inflight.items)


def test_hook_optimizer_starting_below_zero_skips_only_the_negative_step() -> None:
    session = _session()
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    remove = collectives.hook_optimizer(opt, start_step=-1)
    for _ in range(3):
        param.grad = torch.ones(2)
        opt.step()
        dist.all_reduce(torch.ones(1))
    remove()
    assert [s.step for s in _steps(session)] == [0]  # step 1 is still open


def test_a_group_this_rank_is_not_in_is_not_recorded() -> None:
    session = _session()
    rec = session.recorder
    groups_before = dict(rec.group_ranks)
    t = torch.ones(4)
    with collectives.step(0):
        with pytest.warns(UserWarning):
            assert dist.all_reduce(t, group=c10d.GroupMember.NON_GROUP_MEMBER) is None
        with pytest.warns(UserWarning):
            dist.all_reduce(t, group=c10d.GroupMember.NON_GROUP_MEMBER, async_op=True)
        dist.all_reduce(t)
    (summary,) = _steps(session)
    assert (summary.collective_calls, summary.collective_bytes) == (1, 16)
    assert [(r.op, r.seq) for r in rec.history] == [("all_reduce", 1)]
    assert rec.group_ranks == groups_before and rec._inflight == {}


def test_finite_values_whose_sum_overflows_are_no_nan_alarm() -> None:
    session = _session(nonfinite_check_min_bytes=8)
    with collectives.step(0):
        dist.all_reduce(torch.full((64,), 3e38))
    with collectives.step(1):
        dist.all_reduce(torch.full((64,), 3e38, dtype=torch.bfloat16))
    poisoned = torch.full((64,), 3e38)
    poisoned[5] = float("inf")
    with collectives.step(2):
        dist.all_reduce(poisoned)
    nan = torch.ones(64)
    nan[3] = float("nan")
    with collectives.step(3):
        dist.all_reduce(nan)
    assert [(s.step, s.nonfinite_inputs) for s in _steps(session)] == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 1),
    ]


def test_device_path_check_does_not_overflow_either() -> None:
    session = _session(device_path_on_cpu=True, nonfinite_check_min_bytes=8)
    big = torch.full((64,), 3e38)
    with collectives.step(0):
        dist.all_reduce(big.clone())
        dist.all_reduce(big.to(torch.bfloat16))
        dist.all_reduce_coalesced([big.clone(), big.clone()])
        dist.all_reduce(big.double() * 1e269)
    bad = torch.full((64,), 3e38)
    bad[1] = float("nan")
    with collectives.step(1):
        dist.all_reduce(big.clone())
        dist.all_reduce(bad)
    summaries = _until(lambda: len(_steps(session)) == 2 and _steps(session))
    assert [(s.step, s.nonfinite_inputs, s.nonfinite_first_seq) for s in summaries] == [
        (0, 0, None),
        (1, 1, 6),
    ]


def test_a_nested_step_is_refused_and_the_outer_one_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = _session()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        with collectives.step(3):
            dist.all_reduce(torch.ones(1))
            with collectives.step(4):
                dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
        with collectives.step(5):
            with collectives.step(6):
                pass
            dist.all_reduce(torch.ones(1))
    assert [(s.step, s.collective_calls) for s in _steps(session)] == [(3, 3), (5, 1)]
    assert [r.step for r in session.recorder.history] == [3, 3, 3, 5]
    nested = [r.getMessage() for r in caplog.records if "do not nest" in r.getMessage()]
    assert len(nested) == 1 and "step 4" in nested[0] and "step 3" in nested[0]


def test_an_exception_in_a_refused_inner_step_does_not_abort_the_outer_one() -> None:
    session = _session()
    with collectives.step(3):
        with pytest.raises(KeyError), collectives.step(4):
            raise KeyError("inner")
        dist.all_reduce(torch.ones(1))
    assert [(s.step, s.collective_calls) for s in _steps(session)] == [(3, 1)]


def test_mixing_hook_optimizer_and_step_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    _session()
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    remove = collectives.hook_optimizer(opt)
    with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
        for i in range(3):
            with collectives.step(10 + i):
                param.grad = torch.ones(2)
                opt.step()
    remove()
    mixed = [r.getMessage() for r in caplog.records if "hook_optimizer" in r.getMessage()]
    assert len(mixed) == 1
