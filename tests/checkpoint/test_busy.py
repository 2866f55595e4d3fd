"""Training never waits on storage: a save due while the previous one is in flight is
skipped or coalesced, and counted.

The save in flight is held there for real, not by a fake: rank 0 of a two-rank job cannot
commit until rank 1's part exists, so its save stays in flight until the test writes that
part. Had ``save`` waited for the previous one, these tests would hang (and time out).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointConfigError, Checkpointer, CheckpointStore, load


def _ranks(root: Path, policy: str, buffers: int = 1) -> tuple[Checkpointer, Checkpointer]:
    cfg0 = CheckpointConfig(
        root=root,
        writer="thread",
        when_busy=policy,  # type: ignore[arg-type]
        num_buffers=buffers,
        commit_timeout_s=60,
        include_rng=False,
    )
    cfg1 = CheckpointConfig(root=root, writer="thread", when_busy="wait", include_rng=False)
    return (
        Checkpointer(cfg0, rank=0, world_size=2),
        Checkpointer(cfg1, rank=1, world_size=2),
    )


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), value)}


def _committed(root: Path) -> list[int]:
    return [info.step for info in CheckpointStore(root).list() if info.complete]


def test_skip_drops_a_save_due_while_one_is_in_flight_and_counts_it(tmp_path: Path) -> None:
    r0, r1 = _ranks(tmp_path, "skip")
    assert r0.save(_state(1.0), 1) is True
    assert r0.busy()  # waits for rank 1's part
    assert r0.save(_state(2.0), 2) is False  # returns at once instead of waiting
    assert r0.saves_skipped == 1
    r1.save(_state(1.5), 1)
    r1.wait()
    r0.wait()
    assert not r0.busy()
    assert r0.save(_state(3.0), 3) is True  # free again: taken
    r1.save(_state(3.5), 3)
    for ckpt in (r1, r0):
        ckpt.close()
    assert _committed(tmp_path) == [1, 3]
    assert not (tmp_path / "step-000000000002").exists()  # nothing written for the skip
    got = load(tmp_path, {"w": None}, rank=0, restore_rng=False)
    assert got.step == 3 and torch.equal(got.values["w"], _state(3.0)["w"])


def test_required_save_is_never_skipped(tmp_path: Path) -> None:
    r0, r1 = _ranks(tmp_path, "skip")
    r0.save(_state(1.0), 1)
    taken: list[bool] = []
    final = threading.Thread(target=lambda: taken.append(r0.save(_state(2.0), 2, required=True)))
    final.start()  # blocks for the host buffer until step 1 commits
    r1.save(_state(1.0), 1)
    r1.wait()
    final.join(timeout=60)
    assert taken == [True] and r0.saves_skipped == 0
    r1.save(_state(2.0), 2)
    for ckpt in (r1, r0):
        ckpt.close()
    assert _committed(tmp_path) == [1, 2]


def test_coalesce_keeps_only_the_newest_save_behind_the_one_in_flight(tmp_path: Path) -> None:
    r0, r1 = _ranks(tmp_path, "coalesce", buffers=2)
    assert r0.save(_state(1.0), 1)
    assert r0.save(_state(2.0), 2)  # staged, held back
    assert r0.save(_state(3.0), 3)  # replaces step 2 before anything was written
    assert r0.saves_coalesced == 1 and r0.saves_skipped == 0
    assert not (tmp_path / "step-000000000002").exists()
    r1.save(_state(1.5), 1)
    r1.save(_state(3.5), 3)
    for ckpt in (r1, r0):
        ckpt.close()
    assert _committed(tmp_path) == [1, 3]
    got = load(tmp_path, {"w": None}, rank=0, step=3, restore_rng=False)
    assert torch.equal(got.values["w"], _state(3.0)["w"])
    got = load(tmp_path, {"w": None}, rank=0, step=1, restore_rng=False)
    assert torch.equal(got.values["w"], _state(1.0)["w"])


def test_coalesce_needs_a_second_buffer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="num_buffers"):
        Checkpointer(CheckpointConfig(root=tmp_path, when_busy="coalesce"))
    with pytest.raises(CheckpointConfigError, match="when_busy"):
        Checkpointer(CheckpointConfig(root=tmp_path, when_busy="later"))  # type: ignore[arg-type]
