"""``CheckpointConfig.writer_cpus``: the save's threads and the writer process run only on
the CPUs given, so that they never preempt training threads pinned elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.errors import CheckpointConfigError

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform"
)


def _allowed(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_save_threads_and_writer_process_run_on_writer_cpus(tmp_path: Path, writer: str) -> None:
    cpu = max(os.sched_getaffinity(0))
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = os.sched_getaffinity(0)
    cfg = CheckpointConfig(root=tmp_path, writer=writer, writer_cpus=(cpu,))  # type: ignore[arg-type]
    with Checkpointer(cfg) as engine:
        assert engine.save({"model": model, "optim": opt}, step=1)
        engine.wait()
        assert _allowed(engine._copier._thread.native_id or 0) == {cpu}
        if writer == "process":
            pid = engine._writer._proc.pid  # type: ignore[union-attr]
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            assert len(tids) >= 2  # its stdin reader too, started after the pinning
            assert all(_allowed(t) == {cpu} for t in tids)
            reader = engine._writer._reader.native_id  # type: ignore[union-attr]
            assert _allowed(reader or 0) == {cpu}
        else:
            assert _allowed(engine._writer._thread.native_id or 0) == {cpu}  # type: ignore[union-attr]
    assert os.sched_getaffinity(0) == before  # the training thread is the caller's


def test_writer_cpus_outside_the_host_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="writer_cpus"):
        Checkpointer(CheckpointConfig(root=tmp_path, writer_cpus=(os.cpu_count() or 1,)))
