"""Reads never leave the checkpoint through a symbolic link.

The writer makes no links, so a step directory or a file in one that is a link is damage
(``CheckpointCorruptError`` naming it) and the loaders fall back to the previous step, even
where the link's target holds exactly the bytes the manifest promises. Files are opened
relative to the open step directory with ``O_NOFOLLOW``, so the check cannot be raced. The
root itself may be a link, and hard links (the object-store tier's restore) are ordinary
files.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointStore,
    load,
    verify,
)
from checkpoint.manifest import step_dir_name

DATA = "rank-00000.bin"


def _model(step: int) -> torch.nn.Linear:
    torch.manual_seed(step)
    return torch.nn.Linear(8, 4)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    engine = Checkpointer(
        CheckpointConfig(root=root, writer="thread", include_rng=False), rank=0, world_size=1
    )
    for step in (1, 2):
        engine.save({"model": _model(step)}, step)
        engine.wait()
    engine.close()
    return root


def _loads(root: Path) -> tuple[int, list[str], torch.nn.Linear]:
    fresh = torch.nn.Linear(8, 4)
    got = load(root, {"model": fresh}, restore_rng=False)
    assert torch.equal(fresh.weight, _model(got.step).weight)
    return got.step, got.skipped, fresh


def test_data_file_linked_to_an_identical_file_outside_is_refused(
    root: Path, tmp_path: Path
) -> None:
    data = root / step_dir_name(2) / DATA
    outside = tmp_path / "outside.bin"
    shutil.move(data, outside)  # the very bytes the manifest promises
    data.symlink_to(outside)
    with pytest.raises(CheckpointCorruptError, match=rf"{DATA}: a symbolic link \(to '"):
        verify(root, step=2)
    step, skipped, _ = _loads(root)
    assert step == 1 and f"{DATA}: a symbolic link" in skipped[0]


def test_link_inside_the_root_is_refused_too(root: Path) -> None:
    manifest = root / step_dir_name(2) / "rank-00000.json"
    shutil.move(manifest, root / "elsewhere.json")
    manifest.symlink_to("../elsewhere.json")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: a symbolic link"):
        verify(root, step=2)
    assert _loads(root)[0] == 1


def test_linked_step_directory_is_refused(root: Path, tmp_path: Path) -> None:
    step_dir = root / step_dir_name(2)
    shutil.move(step_dir, tmp_path / "moved")
    step_dir.symlink_to(tmp_path / "moved", target_is_directory=True)
    with pytest.raises(CheckpointCorruptError, match=rf"{step_dir_name(2)}: a symbolic link"):
        CheckpointStore(root).open(2)
    step, skipped, _ = _loads(root)
    assert step == 1 and "a symbolic link" in skipped[0]


def test_linked_root_and_hard_linked_files_load(root: Path, tmp_path: Path) -> None:
    data = root / step_dir_name(2) / DATA
    kept = tmp_path / "kept.bin"
    os.link(data, kept)
    data.unlink()
    os.link(kept, data)
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert verify(alias) == 2
    assert _loads(alias)[:2] == (2, [])


def test_latest_that_is_a_fifo_does_not_hang(root: Path) -> None:
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    result: list[int] = []
    reader = threading.Thread(target=lambda: result.append(_loads(root)[0]), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # unblock the open so the thread can end
        with open(root / "latest", "wb"):
            pass
        pytest.fail("load() blocked opening a FIFO named latest")
    assert result == [2]
