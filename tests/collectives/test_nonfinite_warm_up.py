"""The device NaN/Inf check runs once per device before any step needs it.

On an H100 (torch 2.11, NCCL; 28 Nov) a job's first checked step blocked its training
thread ~280 ms at the first reduction and ~185 ms at the second: CUDA loads the check's
kernels lazily and allocates the first pinned buffer, and either synchronizes the device.
``tests/gpu/test_collectives_cuda.py`` shows the effect on a GPU; here the device path on
the CPU shows where the one-time run happens (the first timed call, whatever its step) and
that it happens once per device, and leaves no trace in the step's own results.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives import finite

pytestmark = pytest.mark.usefixtures("single_rank")


def test_the_check_warms_up_once_at_the_first_timed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[tuple[torch.device, int | None]] = []
    real = finite.warm_up

    def counted(like: torch.Tensor, clock: Any) -> None:
        runs.append((like.device, collectives.current().recorder.step))
        real(like, clock)

    monkeypatch.setattr(finite, "warm_up", counted)
    session = collectives.instrument(
        "unit",
        agent_socket="/nonexistent/trainguard.sock",
        device_path_on_cpu=True,
        nonfinite_check_min_bytes=8,
    )
    dist.all_reduce(torch.ones(8))  # the job's first call, outside any step
    assert runs == [(torch.device("cpu"), None)]
    for step in range(2):
        with collectives.step(step):
            dist.all_reduce(torch.ones(8))
            dist.all_reduce(torch.tensor([float("nan")] * 8))
    assert runs == [(torch.device("cpu"), None)]  # never again, never inside a step
    deadline = time.monotonic() + 5
    while len(session.outbox.steps.items) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    steps = list(session.outbox.steps.items)
    assert [(s.nonfinite_inputs, s.nonfinite_first_seq) for s in steps] == [(1, 3), (1, 5)]


def test_no_warm_up_when_the_check_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[torch.device] = []
    monkeypatch.setattr(finite, "warm_up", lambda like, clock: runs.append(like.device))
    collectives.instrument(
        "unit",
        agent_socket="/nonexistent/trainguard.sock",
        device_path_on_cpu=True,
        check_nonfinite=False,
    )
    with collectives.step(0):
        dist.all_reduce(torch.ones(8))
    assert runs == []
