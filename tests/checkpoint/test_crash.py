"""kill -9 at random points during saves never leaves a "latest" that cannot load."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointStore, load
from checkpoint.manifest import MANIFEST_NAME, step_dir_name
from tests.checkpoint.crash_trainer import run
from tests.checkpoint.dist_worker import FORKSERVER_PRELOAD

# Children come from a fork server that imported torch once: a plain fork of this process
# can deadlock in OpenMP once earlier tests ran parallel torch ops, and spawn would import
# torch again for every try.
multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


class Trainer:
    """A child process running crash_trainer.run, to be killed with SIGKILL."""

    def __init__(self, root: Path, writer: str, mode: str, numel: int) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self._rx, tx = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run, args=(str(root), writer, mode, numel, tx))
        self.proc.start()
        tx.close()

    def readline(self) -> str:
        try:
            return str(self._rx.recv())
        except EOFError:
            self.proc.join()
            raise AssertionError(f"trainer exited early with {self.proc.exitcode}") from None

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join()


def _wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}").exists() else ""
        if "State:\tZ" in status:
            return
        assert time.monotonic() < deadline, f"writer {pid} still running"
        time.sleep(0.02)


def _kill_orphaned_writer(pid: int) -> None:
    """SIGKILL the writer its killed trainer left behind, then wait until it is gone.

    The writer is the trainer's child, orphaned now: it may have noticed and exited, and
    been reaped by init (or a subreaper) already, so its pid can be gone before the kill.
    """
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_gone(pid)


def _assert_consistent(root: Path, numel: int) -> int:
    """The latest pointer opens, the newest committed checkpoint loads (the pointer, or one
    committed after it when the kill fell between ``MANIFEST.json`` and ``latest``), and the
    payload equals the step it claims to be."""
    store = CheckpointStore(root)
    pointer = store.latest_pointer()
    assert pointer is not None
    store.open(pointer).close()  # "latest" itself must open, not just some fallback
    payload = torch.nn.ParameterDict({"payload": torch.nn.Parameter(torch.zeros(numel))})
    restored = load(root, {"model": payload, "step": None}, restore_rng=False)
    assert not restored.skipped  # nothing committed is torn
    assert restored.step == restored.values["step"] >= pointer
    assert (restored.step == pointer) == (restored.latest_note == "")
    assert torch.all(payload["payload"] == restored.step), "torn checkpoint"
    return restored.step


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_kill_9_at_random_points_leaves_a_loadable_latest(tmp_path: Path, writer: str) -> None:
    rng = random.Random(f"kill-{writer}")
    for attempt in range(10):
        root = tmp_path / f"run{attempt}"
        trainer = Trainer(root, writer, "loop", 500_000)
        writer_pid = int(trainer.readline().split()[1])
        saved = 0
        target = rng.randint(2, 5)
        while saved < target:
            saved = int(trainer.readline().split()[1])
        time.sleep(rng.uniform(0.0, 0.05))
        trainer.kill()
        if writer_pid:  # the whole node goes: the writer dies too, mid-write
            _kill_orphaned_writer(writer_pid)
        step = _assert_consistent(root, 500_000)
        assert step >= 1
        for path in Path("/dev/shm").glob(f"trainguard-ckpt-{trainer.proc.pid}-*"):
            path.unlink()  # a node that dies loses its tmpfs anyway


@pytest.mark.slow
def test_snapshot_in_host_memory_is_persisted_after_trainer_death(tmp_path: Path) -> None:
    trainer = Trainer(tmp_path, "process", "breakpoint", 16_000_000)  # 64 MB
    writer_pid = int(trainer.readline().split()[1])
    line = trainer.readline()
    assert trainer.proc.pid is not None
    os.kill(trainer.proc.pid, signal.SIGKILL)
    step = int(line.split()[1])
    committed_at_kill = (tmp_path / step_dir_name(step) / MANIFEST_NAME).exists()
    trainer.proc.join()
    assert not committed_at_kill, "write finished before the kill: test proves nothing"
    _wait_gone(writer_pid)
    assert _assert_consistent(tmp_path, 16_000_000) == step == 1
    assert not list(Path("/dev/shm").glob(f"trainguard-ckpt-{trainer.proc.pid}-*"))
