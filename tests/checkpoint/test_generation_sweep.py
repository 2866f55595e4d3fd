"""Acceptance sweep of the checkpoint engine against what a real cluster produces: a
zombie writer of an earlier generation, saves that race or fail part-way, a full disk in
the middle of a shard or of the commit record, reshards to awkward world sizes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from checkpoint import CheckpointStore, verify
from checkpoint._commit import write_fence
from checkpoint._persist import PersistJob, persist_part
from checkpoint.errors import CheckpointSupersededError
from checkpoint.manifest import Entry, rank_data_name, rank_manifest_name, step_dir_name


def _entries(sizes: list[int], seed: int) -> tuple[list[Entry], bytes]:
    entries, blob, offset = [], bytearray(), 0
    for i, size in enumerate(sizes):
        entries.append(Entry(name=f"t{i}", dtype="uint8", shape=[size], offset=offset, nbytes=size))
        blob += bytes((seed + i * 7 + j) % 251 for j in range(size))
        offset += size
    return entries, bytes(blob)


def _job(root: Path, step: int, rank: int, entries: list[Entry], run_id: str) -> PersistJob:
    return PersistJob(
        job_id=1,
        root=str(root),
        step=step,
        rank=rank,
        world_size=2,
        layout={"dp": 2},
        entries=entries,
        keep_last=3,
        commit_timeout_s=10.0,
        chunk_bytes=4096,
        run_id=run_id,
    )


def _save_both(root: Path, step: int, run_id: str, seed: int) -> None:
    entries, blob = _entries([10, 5000, 300], seed)
    for rank in (1, 0):  # rank 0 commits, after its peer's part is there
        persist_part(_job(root, step, rank, entries, run_id), memoryview(blob), lambda i: True)


def _in_another_process(fn: Any, *args: Any) -> None:
    """Run generation B's writers in their own process, as on a cluster (temp names carry
    the pid, so a same-process writer would collide with the zombie's temp file)."""
    proc = multiprocessing.get_context("spawn").Process(target=fn, args=args)
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0


@pytest.mark.parametrize("moved", [True, False], ids=["set-aside", "same-directory"])
def test_a_zombie_rank_that_finishes_after_the_takeover_cannot_replace_new_parts(
    tmp_path: Path, moved: bool
) -> None:
    """Rank 1 of generation A survived the restart and was mid-way through its (large,
    slow) part of step 4 when generation B fenced the root, saved step 4 itself and
    committed it. The zombie then finishes: it must stop, not rename its data file and
    manifest over generation B's committed ones (which would make step 4 fail its
    checksums, or, with ``keep_last=1``, lose every checkpoint).

    ``set-aside``: B's ``set_aside_after`` moved the zombie's directory (and its temp file)
    away. ``same-directory``: the zombie passed its fence check and created the directory
    just after B's set-aside ran, so B saves into the directory the zombie writes in; the
    zombie's files are opened before its first wait, so the callback writes the fence as
    B's set-aside did, and B then saves."""
    _save_both(tmp_path, 2, "gen1-a", seed=1)
    entries, old = _entries([10, 5000, 300], seed=99)

    def zombie_ready(index: int) -> bool:
        if index == len(entries) - 1:  # generation B takes over while the zombie writes
            if moved:
                CheckpointStore(tmp_path).set_aside_after(2, run_id="gen2-b")
            else:
                write_fence(tmp_path, "gen2-b")
            _in_another_process(_save_both, tmp_path, 4, "gen2-b", 2)
        return True

    with pytest.raises(CheckpointSupersededError, match="gen2-b"):
        persist_part(_job(tmp_path, 4, 1, entries, "gen1-a"), memoryview(old), zombie_ready)
    step_dir = tmp_path / step_dir_name(4)
    assert '"run_id":"gen2-b"' in (step_dir / rank_manifest_name(1)).read_text()
    assert verify(tmp_path, step=4) == 4  # every byte against B's checksums
    assert sorted(p.name for p in step_dir.iterdir() if p.name.startswith(".")) == []
    assert old not in (step_dir / rank_data_name(1)).read_bytes()
