"""The lazy asynchronous engine: exact continuation, lazy-copy safety, events, fallback."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from checkpoint import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointStore,
    CheckpointWriteError,
)
from checkpoint.manifest import rank_data_name, step_dir_name
from trainguard.wire import CheckpointEvent

WRITERS = ["thread", "process"]


class Trainer:
    """A small model whose every step consumes RNG (dropout, data) and mutates buffers."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(32, 1),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.data = torch.Generator().manual_seed(1234)
        self.position = 0

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optim": self.opt,
            "sched": self.sched,
            "data": {"generator": self.data.get_state(), "position": self.position},
            "extras": {"note": "hello", "tokens_seen": self.position * 8},
        }

    def restore(self, values: dict[str, Any]) -> None:
        self.data.set_state(values["data"]["generator"])
        self.position = values["data"]["position"]

    def step(self) -> float:
        # Python's and NumPy's generators feed the step too (augmentation-style noise), so a
        # restore that forgot either would change every loss after it.
        noise = random.random() + float(np.random.default_rng(random.getrandbits(32)).random())
        noise += float(np.random.rand())
        x = torch.randn(8, 16, generator=self.data) + 1e-3 * noise
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.position += 1
        return loss.item()


@pytest.mark.parametrize("writer", WRITERS)
def test_restore_continues_bit_for_bit(tmp_path: Path, writer: str) -> None:
    events: list[CheckpointEvent] = []
    cfg = CheckpointConfig(root=tmp_path, writer=writer)  # type: ignore[arg-type]
    trainer = Trainer()
    with Checkpointer(cfg, event_sink=events.append, job="unit") as ckpt:
        for _ in range(4):
            trainer.step()
        ckpt.save(trainer.state(), step=4)
        reference = [trainer.step() for _ in range(6)]
        final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        ckpt.wait()

        resumed = Trainer()
        # The restore must bring back every generator, not rely on luck.
        torch.manual_seed(999)
        random.seed(999)
        np.random.seed(999)
        restored = ckpt.load(resumed.state())
    resumed.restore(restored.values)
    assert restored.step == 4
    assert restored.values["extras"] == {"note": "hello", "tokens_seen": 32}
    assert [resumed.step() for _ in range(6)] == reference
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, final[key]), key
    kinds = [e.kind for e in events]
    assert kinds == ["started", "snapshot_done", "durable", "committed"]
    done = events[1]
    assert done.blocking_s is not None and done.blocking_s > 0
    assert events[2].size_bytes and events[2].size_bytes > 0
    assert {e.job for e in events} == {"unit"} and {e.step for e in events} == {4}


@pytest.mark.parametrize("writer", WRITERS)
def test_optimizer_step_waits_for_the_lazy_copy(tmp_path: Path, writer: str) -> None:
    """Save, then step at once: the checkpoint must hold the pre-step values."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights: a copy that takes a while
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = CheckpointConfig(root=tmp_path, writer=writer, copy_slice_bytes=1 << 20)  # type: ignore[arg-type]
    with Checkpointer(cfg) as ckpt:
        for step in range(3):
            before = model.weight.detach().clone()
            ckpt.save({"model": model, "optim": opt}, step=step)
            opt.step()  # in-place update; the pre-step hook must hold it back
            ckpt.wait()
            fresh = torch.nn.Linear(2048, 2048)
            ckpt.load({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
            assert torch.equal(fresh.weight, before)
            assert not torch.equal(model.weight, before)


def test_buffers_and_loose_tensors_are_copied_before_save_returns(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.step()
    loose = torch.arange(10.0)
    with Checkpointer(CheckpointConfig(root=tmp_path, writer="thread")) as ckpt:
        state = trainer.state()
        state["loose"] = loose
        ckpt.save(state, step=1)
        running_mean = trainer.model[1].running_mean.clone()
        trainer.model.train()
        trainer.model(torch.randn(8, 16) * 5)  # forward mutates BatchNorm statistics
        loose.add_(100)
        ckpt.wait()
        other = Trainer()
        restored = ckpt.load(other.state() | {"loose": None})
    assert torch.equal(other.model[1].running_mean, running_mean)
    assert torch.equal(restored.values["loose"], torch.arange(10.0))


def test_retention_and_fallback_when_newest_is_corrupt(tmp_path: Path) -> None:
    trainer = Trainer()
    cfg = CheckpointConfig(root=tmp_path, keep_last=2, writer="thread", when_busy="wait")
    with Checkpointer(cfg) as ckpt:
        for step in range(1, 5):
            trainer.step()
            ckpt.save(trainer.state(), step=step)
        ckpt.wait()
    store = CheckpointStore(tmp_path)
    assert [i.step for i in store.list()] == [3, 4]
    data_file = tmp_path / step_dir_name(4) / rank_data_name(0)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    fresh = Trainer()
    restored = Checkpointer(CheckpointConfig(root=tmp_path, writer="thread")).load(fresh.state())
    assert restored.step == 3
    assert "rank-00000.bin" in restored.skipped[0] and "CRC mismatch" in restored.skipped[0]
    with pytest.raises(CheckpointCorruptError, match=r"step-000000000004/rank-00000\.bin"):
        Checkpointer(CheckpointConfig(root=tmp_path, writer="thread")).load(fresh.state(), step=4)


@pytest.mark.parametrize("writer", WRITERS)
def test_failed_write_is_reported_and_previous_stands(tmp_path: Path, writer: str) -> None:
    events: list[CheckpointEvent] = []
    trainer = Trainer()
    cfg = CheckpointConfig(root=tmp_path, writer=writer)  # type: ignore[arg-type]
    with Checkpointer(cfg, event_sink=events.append) as ckpt:
        ckpt.save(trainer.state(), step=1)
        ckpt.wait()
        (tmp_path / step_dir_name(2)).write_text("a file where a directory must go")
        ckpt.save(trainer.state(), step=2)
        with pytest.raises(CheckpointWriteError, match="step 2"):
            ckpt.wait()
        ckpt.save(trainer.state(), step=3)  # the engine goes on after a failure
        ckpt.wait()
    assert "failed" in [e.kind for e in events if e.step == 2]
    assert CheckpointStore(tmp_path).latest_pointer() == 3


def test_sink_errors_never_reach_training(tmp_path: Path) -> None:
    def bad_sink(event: CheckpointEvent) -> None:
        raise RuntimeError("agent down")

    with Checkpointer(CheckpointConfig(root=tmp_path, writer="thread"), event_sink=bad_sink) as c:
        c.save({"x": torch.ones(3)}, step=0)
        c.wait()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="keep_last"):
        Checkpointer(CheckpointConfig(root=tmp_path, keep_last=0))
    with pytest.raises(CheckpointConfigError, match="writer"):
        Checkpointer(CheckpointConfig(root=tmp_path, writer="fork"))  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigError, match="hash_threads"):
        Checkpointer(CheckpointConfig(root=tmp_path, hash_threads=0))
    with pytest.raises(CheckpointConfigError, match="writer_nice"):
        Checkpointer(CheckpointConfig(root=tmp_path, writer_nice=20))
    with Checkpointer(CheckpointConfig(root=tmp_path, writer="thread")) as ckpt:
        with pytest.raises(CheckpointConfigError, match="mapping"):
            ckpt.save([torch.ones(1)], step=0)  # type: ignore[arg-type]
        with pytest.raises(CheckpointConfigError, match="reserved"):
            ckpt.save({"__rng__": 1}, step=0)
        with pytest.raises(CheckpointConfigError, match="step"):
            ckpt.save({}, step=-1)


def test_host_buffer_is_reused_across_saves(tmp_path: Path) -> None:
    trainer = Trainer()
    with Checkpointer(CheckpointConfig(root=tmp_path, writer="process")) as ckpt:
        ckpt.save(trainer.state(), step=1)
        first = ckpt._slots[0].buffer
        ckpt.save(trainer.state(), step=2)
        assert ckpt._slots[0].buffer is first
        ckpt.wait()
    assert not list(Path("/dev/shm").glob(f"trainguard-ckpt-{__import__('os').getpid()}-*"))


def test_dead_writer_process_costs_one_checkpoint_not_the_job(tmp_path: Path) -> None:
    import os
    import signal
    import time

    events: list[CheckpointEvent] = []
    trainer = Trainer()
    cfg = CheckpointConfig(root=tmp_path, writer="process")
    with Checkpointer(cfg, event_sink=events.append) as ckpt:
        ckpt.save(trainer.state(), step=1)
        ckpt.wait()
        os.kill(ckpt._writer._proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while ckpt._writer.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        trainer.step()
        ckpt.save(trainer.state(), step=2)  # starts a new writer, no exception
        ckpt.wait()
    assert CheckpointStore(tmp_path).latest_pointer() == 2
    assert [e.kind for e in events if e.step == 2][-1] == "committed"


@pytest.mark.parametrize("writer", WRITERS)
def test_mirror_tier_gets_a_committed_copy(tmp_path: Path, writer: str) -> None:
    import shutil

    local, mirror = tmp_path / "local", tmp_path / "persistent"
    trainer = Trainer()
    cfg = CheckpointConfig(
        root=local,
        mirror_root=mirror,
        keep_last=1,
        writer=writer,  # type: ignore[arg-type]
        when_busy="wait",
    )
    with Checkpointer(cfg) as ckpt:
        for step in (1, 2):
            trainer.step()
            ckpt.save(trainer.state(), step=step)
        ckpt.wait()
        reference = trainer.step()
    for root in (local, mirror):
        assert [i.step for i in CheckpointStore(root).list()] == [2]
        with CheckpointStore(root).open_latest() as reader:
            reader.verify()
    shutil.rmtree(local)  # the node's disk is gone; the persistent copy is enough
    resumed = Trainer()
    restored = Checkpointer(CheckpointConfig(root=mirror, writer="thread")).load(resumed.state())
    resumed.restore(restored.values)
    assert restored.step == 2 and resumed.step() == reference


def test_stale_shared_buffers_of_dead_trainers_are_reaped(tmp_path: Path) -> None:
    import os
    import subprocess

    from checkpoint._stage import PREFIX, reap_stale_buffers

    proc = subprocess.Popen(["true"])  # its pid, once reaped, belongs to no process
    proc.wait()
    stale = tmp_path / f"{PREFIX}{proc.pid}-abc"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-def"
    alive = tmp_path / f"{PREFIX}1-ghi"  # pid 1 always exists
    for path in (stale, mine, alive):
        path.write_bytes(b"x")
    assert reap_stale_buffers(tmp_path) == [stale]
    assert mine.exists() and alive.exists()


@pytest.mark.parametrize("writer", WRITERS)
def test_two_host_buffers_keep_back_to_back_saves_apart(tmp_path: Path, writer: str) -> None:
    """With two buffers a save overlaps the previous write; each step must keep its own bytes."""
    cfg = CheckpointConfig(
        root=tmp_path,
        writer=writer,  # type: ignore[arg-type]
        num_buffers=2,
        keep_last=5,
        when_busy="wait",
    )
    trainer = Trainer()
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(cfg) as ckpt:
        for step in range(1, 5):
            trainer.step()
            expected[step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            ckpt.save(trainer.state(), step=step)
        ckpt.wait()
        for step, weights in expected.items():
            fresh = Trainer()
            assert ckpt.load(fresh.state(), step=step).step == step
            for key, value in fresh.model.state_dict().items():
                assert torch.equal(value, weights[key]), (step, key)
    assert [info.step for info in CheckpointStore(tmp_path).list() if info.complete] == [1, 2, 3, 4]
