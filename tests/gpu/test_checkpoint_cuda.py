"""The checkpoint copier on a real GPU (``make gpu-check``; skipped without CUDA).

Issue 19, "correct on CUDA": the copier thread copies from ``cuda:1`` when there are two
GPUs (``cuda:0`` otherwise) with the source device current in its own thread, on a stream
of that device, into pinned host buffers reused across saves, ordered after the kernels the
trainer queued before ``save``; the bytes on disk must equal the device tensors at ``save``
even though the optimizer steps right after it. The same code path runs on CPU in
tests/checkpoint/test_stage.py and test_engine.py.

These tests have not run yet: no GPU was available where they were written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer, load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: GPU cycles ``torch.cuda._sleep`` spins so that the update is still queued at ``save``.
BUSY_CYCLES = 200_000_000


def _device() -> torch.device:
    return torch.device("cuda", 1 if torch.cuda.device_count() >= 2 else 0)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_copier_stages_device_tensors_exactly(tmp_path: Path, writer: str) -> None:
    dev = _device()
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = CheckpointConfig(root=tmp_path, writer=writer, when_busy="wait", copy_slice_bytes=1 << 20)  # type: ignore[arg-type]
    expected: dict[int, torch.Tensor] = {}
    with Checkpointer(cfg) as ckpt:
        for step in range(3):
            torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[attr-defined]
            with torch.no_grad():
                model.weight.add_(1.0)  # queued behind the sleep when save is called
            expected[step] = model.weight.detach().cpu().clone()  # syncs: the reference
            torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[attr-defined]
            with torch.no_grad():
                model.weight.mul_(1.0)  # keeps the stream busy at save
            ckpt.save({"model": model, "optim": opt}, step=step)
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()  # must not overwrite the weights before the copier read them
        ckpt.wait()
        first = ckpt._slots[0].buffer
        assert first is not None and first.pinned  # pinned, and the same buffer each save
    for step, weight in expected.items():
        fresh = torch.nn.Linear(1024, 1024)
        load(tmp_path, {"model": fresh}, step=step, restore_rng=False)
        assert torch.equal(fresh.weight, weight), step


def test_copier_thread_uses_the_source_devices_stream(tmp_path: Path) -> None:
    dev = _device()
    src = torch.arange(1 << 20, device=dev, dtype=torch.float32)
    seen: list[int] = []
    cfg = CheckpointConfig(root=tmp_path, writer="thread", when_busy="wait")
    with Checkpointer(cfg) as ckpt:
        model = torch.nn.Module()
        model.p = torch.nn.Parameter(src.clone())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt.save({"model": model, "optim": opt}, step=1)
        ckpt.wait()
        streams = ckpt._copier._streams
        seen = [s.device.index for s in streams.values()]
    assert seen == [dev.index]
    fresh = torch.nn.Module()
    fresh.p = torch.nn.Parameter(torch.empty(1 << 20))
    load(tmp_path, {"model": fresh}, step=1, restore_rng=False)
    assert torch.equal(fresh.p, src.cpu())
