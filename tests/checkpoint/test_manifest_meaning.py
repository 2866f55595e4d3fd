"""A re-checksummed, edited manifest is refused, never loaded as wrong numbers; and a save
whose ``latest`` could not be moved is committed, not failed.

Checksums cover bytes, not their meaning: a buggy tool (or a person) that edits a rank
manifest entry's ``dtype``, ``shape``, ``offset`` or ``nbytes`` and then records the edited
manifest's SHA-256 in ``MANIFEST.json`` (as the writer computes it) passes every checksum.
Each test saves two real checkpoints with the real engine, edits step 2 that way, and
expects ``load()`` to pass over step 2 to step 1 with a one-line reason naming the file and
the tensor (step 1's values bit for bit), as it does for any damage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from checkpoint.manifest import MANIFEST_NAME, step_dir_name

STEPS = (1, 2)


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {
        "model": torch.nn.Linear(6, 3),  # weight 72 bytes, bias 12 (52 bytes of padding)
        "a": torch.randn(4, 4) + 10 * step,  # a and b: same dtype and size
        "b": torch.randn(4, 4) - 10 * step,
        "v": torch.arange(5, dtype=torch.float64) * step,
    }


def _config(root: Path) -> CheckpointConfig:
    return CheckpointConfig(root=root, writer="thread", include_rng=False, keep_last=5)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("meaning") / "ckpt"
    with Checkpointer(_config(root), rank=0, world_size=1) as ckpt:
        for step in STEPS:
            ckpt.save(_state(step), step)
            ckpt.wait()
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(template, dest)
    return dest


def _edit(root: Path, change: Callable[[dict[str, Any]], None], step: int = 2) -> None:
    """Edit step ``step``'s rank manifest with ``change(entries by name)``, then re-pin its
    SHA-256 in ``MANIFEST.json`` exactly as the writer computes it (sorted, compact JSON;
    SHA-256 of those bytes): every checksum agrees with the edited manifest."""
    step_dir = root / step_dir_name(step)
    part_path = step_dir / "rank-00000.json"
    doc = json.loads(part_path.read_bytes())
    change({e["name"]: e for e in doc["entries"]})
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    part_path.write_bytes(raw)
    manifest_path = step_dir / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_bytes())
    manifest["ranks"][0]["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    manifest_path.write_bytes(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _fresh() -> dict[str, Any]:
    return {"model": torch.nn.Linear(6, 3), "a": None, "b": None, "v": None}


def _loads_step_1(root: Path, *why: str) -> None:
    """``load()`` passes over step 2, saying why in one line, and restores step 1 exactly."""
    state = _fresh()
    got = load(root, state, restore_rng=False)
    assert got.step == 1, f"loaded the edited step 2: {got.values}"
    assert len(got.skipped) == 1 and "\n" not in got.skipped[0]
    for word in why:
        assert word in got.skipped[0], got.skipped[0]
    want = _state(1)
    assert torch.equal(state["model"].weight, want["model"].weight)
    assert torch.equal(state["model"].bias, want["model"].bias)
    for key in ("a", "b", "v"):
        value = got.values[key]
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
    with pytest.raises(CheckpointCorruptError):
        load(root, _fresh(), step=2, restore_rng=False)


def test_dtype_of_the_same_size_is_refused(root: Path) -> None:
    """float32 -> int32: ``nbytes`` still equals elements x 4; only the skeleton, inside
    the CRC-checked data file, still says what the writer stored."""
    _edit(root, lambda e: e["a"].update(dtype="int32"))
    _loads_step_1(root, "rank-00000.bin", "'a'", "int32", "float32")


def test_dtype_and_nbytes_shrunk_together_are_refused(root: Path) -> None:
    """float32 -> float16 with ``nbytes`` halved to match: consistent, inside the file,
    overlapping nothing; it would read the first half of ``a``'s bytes as halves."""
    _edit(root, lambda e: e["a"].update(dtype="float16", nbytes=32))
    _loads_step_1(root, "'a'", "float16")


def test_dtype_and_nbytes_grown_into_the_next_tensor_are_refused(root: Path) -> None:
    _edit(root, lambda e: e["a"].update(dtype="float64", nbytes=128))
    _loads_step_1(root, "rank-00000.json", "overlap", "'a'", "'b'")


def test_shape_with_the_same_byte_count_is_refused(root: Path) -> None:
    """[4, 4] -> [16]: same bytes, a 1-D view its global map allows (a flat partition)."""
    _edit(root, lambda e: e["a"].update(shape=[16]))
    _loads_step_1(root, "'a'", "[16]", "[4, 4]")


def test_offset_onto_another_tensor_is_refused(root: Path) -> None:
    def change(e: dict[str, Any]) -> None:
        e["a"]["offset"] = e["b"]["offset"]

    _edit(root, change)
    _loads_step_1(root, "rank-00000.json", "overlap", "'a'", "'b'")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: .*overlap"):
        verify(root, step=2)
    assert verify(root) == 1  # what load() resumes from, as checkpoint verify says


def test_offset_shifted_inside_the_padding_is_refused(root: Path) -> None:
    """The bias (12 bytes) is followed by 52 bytes of padding: moved 8 bytes on, it still
    overlaps nothing and stays inside the file, but reads the wrong bytes."""
    _edit(root, lambda e: e["model/bias"].update(offset=e["model/bias"]["offset"] + 8))
    _loads_step_1(root, "rank-00000.json", "'model/bias'", "aligned")


def test_offsets_of_two_equal_tensors_swapped_are_refused(root: Path) -> None:
    def change(e: dict[str, Any]) -> None:
        e["a"]["offset"], e["b"]["offset"] = e["b"]["offset"], e["a"]["offset"]

    _edit(root, change)
    _loads_step_1(root, "rank-00000.json", "'a'", "'b'", "order")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: .*order"):
        verify(root, step=2, deep=False)


def test_layout_checks_run_when_any_reader_opens_the_step(root: Path) -> None:
    """The layout checks live in the rank manifest parser, which opening a step runs:
    ``reshard``, ``convert``, ``inspect`` and the object-store tier see them too."""
    _edit(root, lambda e: None)  # re-pinned but unchanged: loads
    got = load(root, _fresh(), restore_rng=False)
    assert got.step == 2 and not got.skipped and torch.equal(got.values["a"], _state(2)["a"])
    _edit(root, lambda e: e["b"].update(offset=e["a"]["offset"]))
    with pytest.raises(CheckpointCorruptError, match=r"entries\[\d+\]\.offset: .*overlap"):
        CheckpointStore(root).open(2).close()


def test_a_latest_that_cannot_be_moved_leaves_the_save_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``MANIFEST.json`` is the commit point: a ``latest`` rename that fails afterwards (here
    ``latest`` is a directory, so the rename is refused) must not report the save failed.
    The save is committed, a one-line warning says ``latest`` was not moved, ``load()``
    finds the step by scanning, and the next save moves ``latest`` again."""
    root = tmp_path / "ckpt"
    events: list[tuple[str, int]] = []
    sink = lambda ev: events.append((ev.kind, ev.step))  # noqa: E731
    with Checkpointer(_config(root), rank=0, world_size=1, event_sink=sink) as ckpt:
        ckpt.save(_state(1), 1)
        ckpt.wait()
        (root / "latest").unlink()
        (root / "latest").mkdir()
        (root / "latest" / "keep").write_text("a rename cannot replace a non-empty directory")
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            ckpt.save(_state(2), 2)
            ckpt.wait()  # raised CheckpointWriteError: the save was reported failed
        assert ("committed", 2) in events and ("failed", 2) not in events
        notes = [r.getMessage() for r in caplog.records if "latest not moved" in r.getMessage()]
        assert len(notes) == 1 and "\n" not in notes[0] and step_dir_name(2) in notes[0]
        assert (root / step_dir_name(2) / MANIFEST_NAME).is_file()
        state = _fresh()
        got = load(root, state, restore_rng=False)
        assert got.step == 2 and "latest" in got.latest_note
        assert torch.equal(got.values["a"], _state(2)["a"])
        shutil.rmtree(root / "latest")
        ckpt.save(_state(3), 3)
        ckpt.wait()
    assert (root / "latest").read_text() == step_dir_name(3) + "\n"
    assert load(root, _fresh(), restore_rng=False).latest_note == ""
