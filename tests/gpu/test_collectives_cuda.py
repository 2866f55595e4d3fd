"""The collectives' CUDA paths on a real GPU (``make gpu-check``; skipped without CUDA).

Covers issue 15 items 1-3 where they can only be proven on a device: CUDA-event timing of
synchronous, asynchronous and future-driven (DDP comm hook) calls that stays in flight while
the stream is busy and never synchronizes the training thread (``torch.cuda`` sync debug
mode set to ``error`` around the steps), the NaN/Inf flag read back without a sync, and a
link probe buffer on ``cuda:LOCAL_RANK`` on its own NCCL group. One rank, NCCL.

First run on a GPU on 28 Nov (one H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130,
NCCL; the machine's own Python with pydantic carried as wheels, ``--noconftest``): they
found three bugs, since fixed. ``instrument()`` raised AttributeError on torch 2.11 (no
``all_gather_single``); a job's first checked step blocked its training thread ~280 ms and
~185 ms at its first two reductions (the NaN/Inf check's kernels loaded lazily: now warmed
at the first timed call, ``collectives.finite.warm_up``); and the NaN test expected the bad
call's group sequence as 2, but ``_session``'s warm-up call is the group's first. All 10
tests in tests/gpu then passed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.timing import CudaEventClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL"),
]

#: GPU cycles ``torch.cuda._sleep`` spins: ~0.1-0.3 s on current parts, enough to see a
#: call still in flight after the host has returned from it.
BUSY_CYCLES = 300_000_000


@pytest.fixture
def nccl_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        collectives.uninstrument()
        dist.destroy_process_group()


def _session(**overrides: Any) -> Any:
    overrides.setdefault("agent_socket", "/nonexistent/trainguard.sock")
    overrides.setdefault("watchdog_interval_s", 0.02)
    session = collectives.instrument("gpu-check", **overrides)
    # NCCL sets its communicator up at the first call, synchronizing on the way: do that
    # before the sync debug mode watches, outside any step.
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    return session


def _until(predicate: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.usefixtures("nccl_rank")
def test_cuda_calls_are_timed_on_the_stream_and_never_sync_the_host() -> None:
    session = _session()
    assert isinstance(session.instrumenter.clock, CudaEventClock)
    x = torch.ones(1 << 20, device="cuda")
    rec = session.recorder
    assert _until(lambda: not rec._inflight)  # the warm-up call is closed
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collectives.step(0):
            torch.cuda._sleep(BUSY_CYCLES)  # the stream is busy: NCCL runs after this
            dist.all_reduce(x)
            in_flight_after_sync_call = len(rec._inflight)
            work = dist.all_reduce(x, async_op=True)
            fut = dist.all_reduce(x, async_op=True).get_future()
            work.wait()  # a stream dependency, not a host wait
            in_flight_after_wait = len(rec._inflight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert in_flight_after_sync_call == 1
    assert in_flight_after_wait == 3  # the GPU is still sleeping: nothing has finished
    assert _until(lambda: session.outbox.steps.items)
    (summary,) = list(session.outbox.steps.items)
    fut.wait()
    calls = [c for c in rec.history if c.step == 0]
    assert [c.op for c in calls] == ["all_reduce"] * 3
    assert all(c.events is not None and c.blocked_s > 0 for c in calls)
    # host launch time is kept apart from the device time and is far shorter than the sleep
    assert summary.collective_enqueue_s is not None
    assert summary.collective_enqueue_s == pytest.approx(sum(c.enqueue_s for c in calls))
    assert summary.step_time_s < summary.collective_enqueue_s + 0.5


@pytest.mark.usefixtures("nccl_rank")
def test_nan_in_a_cuda_gradient_is_counted_without_a_sync() -> None:
    session = _session()
    good = torch.ones(1024, device="cuda")
    bad = torch.full((1024,), float("nan"), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collectives.step(0):
            dist.all_reduce(good)
            dist.all_reduce(bad)
            dist.all_reduce(good)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _until(lambda: session.outbox.steps.items)
    (summary,) = list(session.outbox.steps.items)
    assert summary.nonfinite_inputs == 1
    # The group's sequence counts every call on it, _session's warm-up (seq 1) included:
    # the bad input is the group's third call (the test expected 2 until it first ran on a
    # GPU, 28 Nov: H100, torch 2.11, NCCL; the flag itself was read back right).
    assert (summary.nonfinite_first_op, summary.nonfinite_first_seq) == ("all_reduce", 3)


@pytest.mark.usefixtures("nccl_rank")
def test_probe_runs_on_the_ranks_gpu() -> None:
    session = _session()
    assert session.probe_device == torch.device("cuda", int(os.environ["LOCAL_RANK"]))


@pytest.mark.usefixtures("nccl_rank")
def test_a_coalesced_block_is_timed_as_one_collective() -> None:
    """A coalescing block's calls launch together at its end (one NCCL group, one Work):
    one start mark before the first call and one end mark after the block, so the record
    stays in flight while the stream is still busy ahead of the block; calls queued in a
    ``device=`` block (broadcast here) share the block's marks."""
    session = _session()
    rec = session.recorder
    assert _until(lambda: not rec._inflight)
    xs = [torch.ones(1 << 16, device="cuda") for _ in range(3)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collectives.step(0):
            torch.cuda._sleep(BUSY_CYCLES)
            with dist._coalescing_manager(async_ops=True) as cm:
                for x in xs:
                    dist.all_reduce(x, async_op=True)
            cm.wait()  # a stream dependency (not blocking wait)
            with dist._coalescing_manager(device=torch.device("cuda")):
                dist.broadcast(xs[0], 0)
                dist.broadcast(xs[1], 0)
            in_flight = len(rec._inflight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert in_flight == 3  # the GPU is still sleeping
    assert _until(lambda: session.outbox.steps.items)
    calls = [c for c in rec.history if c.step == 0]
    assert sorted(c.op for c in calls) == ["all_reduce_coalesced", "broadcast", "broadcast"]
    merged = next(c for c in calls if c.op == "all_reduce_coalesced")
    assert merged.size_bytes == sum(x.nbytes for x in xs)
    broadcasts = [c for c in calls if c.op == "broadcast"]
    assert broadcasts[0].events == broadcasts[1].events  # the block's two marks
    assert all(c.events is not None and c.blocked_s > 0 for c in calls)


@pytest.mark.usefixtures("nccl_rank")
def test_the_rank_sends_nvmls_uuid_of_its_gpu() -> None:
    """The hello's ``gpu_uuid`` is NVML's UUID of the GPU the rank runs on (the same board:
    same PCI address), so the agent can map it to the node's NVML index (CUDA's device
    number is relative to ``CUDA_VISIBLE_DEVICES``)."""
    pynvml = pytest.importorskip("pynvml")
    session = _session()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(session.gpu_uuid)
        nvml_uuid = pynvml.nvmlDeviceGetUUID(handle)
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
    finally:
        pynvml.nvmlShutdown()
    if isinstance(nvml_uuid, bytes):
        nvml_uuid = nvml_uuid.decode()
    assert session.client.hello.gpu_uuid == session.gpu_uuid
    assert session.gpu_uuid.lower() == nvml_uuid.lower()  # NVML: GPU-<lower-case hex>
    bus = getattr(props, "pci_bus_id", None)  # torch's stubs do not list the PCI fields
    if bus is not None:
        assert (pci.bus, pci.device) == (bus, getattr(props, "pci_device_id", pci.device))
