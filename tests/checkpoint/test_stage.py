"""Stage 2 (copy to host) through the same code path the CUDA copier takes, on CPU.

The device choice is a pure function of the source's device object, so it is tested here
with ``cuda:1`` devices without a GPU; the optimizer guard is tested with real tensors and
the engine's own wait function. ``tests/gpu/test_checkpoint_cuda.py`` runs the copier on a
real device.
"""

from __future__ import annotations

import threading

import torch

from checkpoint._stage import (
    HostBuffer,
    Slot,
    Snapshot,
    copy_device,
    guard_positions,
    slice_ends,
    source_devices,
    wait_guard,
)


def test_copy_device_is_the_source_device_never_the_threads_default() -> None:
    assert copy_device(torch.device("cpu")) is None
    assert copy_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert copy_device(torch.device("cuda", 3), current=0) == torch.device("cuda", 3)
    assert copy_device(torch.device("cuda"), current=2) == torch.device("cuda", 2)


def test_source_devices_are_distinct_cuda_devices_in_first_seen_order() -> None:
    class Fake:  # a tensor-like with only a device: no GPU needed to describe one
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    srcs = [Fake("cpu"), Fake("cuda:1"), Fake("cuda:0"), Fake("cuda:1")]
    assert source_devices(srcs) == [torch.device("cuda", 1), torch.device("cuda", 0)]  # type: ignore[arg-type]


def test_slices_report_every_slice_bytes_and_after_the_last_tensor() -> None:
    assert slice_ends([4, 4, 4, 4, 1], 8) == [2, 4, 5]
    assert slice_ends([100], 8) == [1]
    assert slice_ends([], 8) == []


def _snapshot(lazy: list[tuple[int, torch.Tensor, torch.Tensor]]) -> Snapshot:
    buf = HostBuffer(4096, shared=False, pin=False)
    return Snapshot(
        snap_id=1, step=1, slot=Slot(), buffer=buf, lazy=lazy, ready=1, t0=0.0, total_bytes=64
    )


def test_an_optimizer_waits_only_for_the_tensors_it_would_overwrite() -> None:
    a, b = torch.ones(4), torch.ones(4)
    lazy = [(1, a, torch.empty(4)), (2, b, torch.empty(4))]
    owners = {
        10: {a.untyped_storage().data_ptr()},
        20: {b.untyped_storage().data_ptr()},
        30: {torch.ones(1).untyped_storage().data_ptr()},  # touches nothing saved
    }
    guards = guard_positions(lazy, owners)
    assert guards == {10: 0, 20: 1}
    snap = _snapshot(lazy)
    snap.guards = guards
    cond = threading.Condition()
    snap.copied_upto = 1  # a copied, b not yet
    wait_guard(cond, snap, 10)  # returns at once: a is safe to overwrite
    wait_guard(cond, snap, 30)
    assert snap.blocking_s == 0.0
    waiter = threading.Thread(target=wait_guard, args=(cond, snap, 20))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # b's optimizer holds until b is copied
    with cond:
        snap.copied_upto = 2
        cond.notify_all()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and snap.blocking_s > 0
    snap.buffer.close()
