"""A rank manifest must agree with the global map it carries, and the ranks' fragments of
one global tensor must agree with each other (a buggy writer, not a bad disk: the edited
manifest is re-pinned in MANIFEST.json). Both are damage: verify refuses the step and the
loaders fall back to the previous one instead of reading the bytes as something else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointCorruptError, load, reshard, verify
from checkpoint.manifest import MANIFEST_NAME, step_dir_name
from tests.checkpoint.megatron import (
    PADDED_PER_TP,
    full_state,
    layouts,
    ln_mean,
    rank_state,
    save_sharded,
)

TP, DP = 2, 2


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_sharded(root, TP, DP, full_state(seed=step), PADDED_PER_TP, step=step)
    return root


def _edit_entry(root: Path, rank: int, name: str, **fields: Any) -> int:
    """Set ``fields`` of entry ``name`` in step 2's manifest of ``rank`` and re-pin it;
    returns the entry's index."""
    step_dir = root / step_dir_name(2)
    path = step_dir / f"rank-{rank:05d}.json"
    doc = json.loads(path.read_bytes())
    index = next(i for i, e in enumerate(doc["entries"]) if e["name"] == name)
    doc["entries"][index].update(fields)
    path.write_bytes(json.dumps(doc).encode())
    top = json.loads((step_dir / MANIFEST_NAME).read_bytes())
    top["ranks"][rank]["manifest_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (step_dir / MANIFEST_NAME).write_bytes(json.dumps(top).encode())
    return index


def test_the_real_layouts_pass(root: Path) -> None:
    """Vocabulary padding, fused parts, TP shards, replicas, averages, ZeRO flat slices."""
    assert verify(root, step=2) == 2


def test_entry_shape_that_disagrees_with_its_global_map_is_damage(root: Path) -> None:
    """Same bytes, transposed shape: load() would build a [4, 6] tensor while the map (and
    convert) lay the bytes out as [6, 4]."""
    index = _edit_entry(root, 1, "model/qkv.weight", shape=[4, 6])
    with pytest.raises(
        CheckpointCorruptError, match=rf"rank-00001\.json: field entries\[{index}\]\.shape: "
    ):
        verify(root, step=2)
    want, _ = rank_state(full_state(seed=1), layouts(TP, DP)[1], PADDED_PER_TP)
    got = load(root, dict.fromkeys(want), rank=1, restore_rng=False)  # plain values back
    assert got.step == 1 and f"entries[{index}].shape" in got.skipped[0]
    assert all(torch.equal(got.values[k], want[k]) for k in want)
    resharded = reshard(root, {"model/qkv.weight": torch.zeros(12, 4)})
    assert resharded.step == 1 and f"entries[{index}].shape" in resharded.skipped[0]


def test_fragments_of_one_tensor_that_disagree_across_ranks_are_damage(root: Path) -> None:
    """Each manifest is consistent on its own (float32 -> int32 keeps nbytes), but rank 1
    describes the averaged model/ln.weight differently from rank 0: resharding refuses the
    step and falls back instead of averaging rank 1's bytes read as integers."""
    _edit_entry(root, 1, "model/ln.weight", dtype="int32")
    target = {"model/ln.weight": torch.zeros(4)}
    got = reshard(root, target)
    assert got.step == 1
    assert "rank-00001.json: entry 'model/ln.weight' field dtype: 'int32'" in got.skipped[0]
    assert torch.equal(target["model/ln.weight"], ln_mean(full_state(seed=1), TP * DP))
    with pytest.raises(CheckpointCorruptError, match="field dtype"):
        reshard(root, target, step=2)
