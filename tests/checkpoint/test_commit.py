"""The commit protocol, retention and integrity checks of the storage layer, without torch."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from checkpoint import CheckpointStore
from checkpoint._commit import (
    apply_retention,
    commit,
    read_fence,
    write_fence,
)
from checkpoint._persist import PersistJob, persist_part
from checkpoint._store import PassedOver
from checkpoint._write import DataFileWriter
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointSupersededError,
)
from checkpoint.manifest import MANIFEST_NAME, Entry, rank_data_name, step_dir_name


def _entries(sizes: list[int]) -> tuple[list[Entry], bytes]:
    entries, blob, offset = [], bytearray(), 0
    for i, size in enumerate(sizes):
        entries.append(Entry(name=f"t{i}", dtype="uint8", shape=[size], offset=offset, nbytes=size))
        blob += bytes((i * 7 + j) % 251 for j in range(size))
        offset += size
    return entries, bytes(blob)


def _save(
    root: Path,
    step: int,
    *,
    world: int = 1,
    keep_last: int = 3,
    sizes: tuple[int, ...] = (10, 5000, 300),
    chunk_bytes: int = 4096,
    timeout_s: float = 5.0,
    ranks: list[int] | None = None,
    run_id: str = "",
) -> bytes:
    entries, blob = _entries(list(sizes))
    for rank in ranks if ranks is not None else reversed(range(world)):  # rank 0 commits
        job = PersistJob(
            job_id=1,
            root=str(root),
            step=step,
            rank=rank,
            world_size=world,
            layout={"dp": world},
            entries=entries,
            keep_last=keep_last,
            commit_timeout_s=timeout_s,
            chunk_bytes=chunk_bytes,
            run_id=run_id,
        )
        persist_part(job, memoryview(blob), lambda i: True)
    return blob


def test_commit_writes_manifest_and_latest(tmp_path: Path) -> None:
    blob = _save(tmp_path, 7)
    store = CheckpointStore(tmp_path)
    assert store.latest_pointer() == 7
    with store.open_latest() as reader:
        assert reader.step == 7
        reader.verify(deep=True)
        entry = reader.entries(0)[1]
        assert reader.read_entry(0, entry) == blob[entry.offset : entry.offset + entry.nbytes]
        assert reader.manifest.layout == {"dp": 1}


def test_chunk_crcs_match_a_fresh_hash(tmp_path: Path) -> None:
    writer = DataFileWriter(tmp_path / "f.bin", chunk_bytes=4096, sha256=True)
    data = os.urandom(10_000)
    writer.write(data[:100])
    writer.write(data[100:])
    info = writer.finish()
    import hashlib
    import zlib

    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.chunk_crc32 == [zlib.crc32(data[i : i + 4096]) for i in range(0, 10_000, 4096)]
    assert not list(tmp_path.glob(".*tmp*"))


def test_rank0_waits_for_every_rank_before_committing(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            _save(tmp_path, 3, world=2, ranks=[0], timeout_s=10)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    t = threading.Thread(target=rank0)
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive(), "rank 0 committed before rank 1 was durable"
    assert not (tmp_path / step_dir_name(3) / MANIFEST_NAME).exists()
    assert CheckpointStore(tmp_path).latest_pointer() is None
    _save(tmp_path, 3, world=2, ranks=[1])
    t.join(timeout=10)
    assert not errors
    with CheckpointStore(tmp_path).open_latest() as reader:
        assert reader.manifest.world_size == 2
        reader.verify()


def test_missing_rank_times_out_and_keeps_previous_latest(tmp_path: Path) -> None:
    _save(tmp_path, 1, world=2)
    with pytest.raises(CheckpointIncompleteError, match=r"ranks \[1\]"):
        _save(tmp_path, 2, world=2, ranks=[0], timeout_s=0.3)
    store = CheckpointStore(tmp_path)
    assert store.latest_pointer() == 1
    with store.open_latest() as reader:
        assert reader.step == 1


def test_retention_keeps_last_n_complete_and_skips_newer_partials(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    partial = tmp_path / step_dir_name(9)
    partial.mkdir()
    (partial / rank_data_name(0)).write_bytes(b"x")
    old_partial = tmp_path / step_dir_name(3) / "junk"
    old_partial.write_bytes(b"")
    _save(tmp_path, 5, keep_last=2)
    steps = [info.step for info in CheckpointStore(tmp_path).list()]
    assert steps == [4, 5, 9]  # 9 is a save still in flight: never touched
    assert apply_retention(tmp_path, keep_last=1, newest_committed=5) == [4]


def test_flipped_byte_is_caught_naming_file_and_tensor(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    data_file = tmp_path / step_dir_name(1) / rank_data_name(0)
    raw = bytearray(data_file.read_bytes())
    raw[4200] ^= 0x01
    data_file.write_bytes(bytes(raw))
    store = CheckpointStore(tmp_path)
    with store.open(1) as reader:
        with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.bin.*tensor t1"):
            reader.read_entry(0, reader.entries(0)[1])
        with pytest.raises(CheckpointCorruptError, match="CRC mismatch"):
            reader.verify(deep=True)
        # t0 lives in an undamaged chunk? No: chunk 0 covers 0..4095, t0 is readable.
        assert reader.read_entry(0, reader.entries(0)[0])


def test_truncated_and_missing_shards_are_refused(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    data_file = tmp_path / step_dir_name(2) / rank_data_name(0)
    data_file.write_bytes(data_file.read_bytes()[:-1])
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.bin: .* bytes on disk"):
        store.open(2)
    data_file.unlink()
    with pytest.raises(CheckpointIncompleteError, match=r"rank-00000\.bin: data file missing"):
        store.open(2)
    with store.open_latest() as reader:  # falls back to the previous complete one
        assert reader.step == 1


def test_open_latest_records_what_it_passed_over_instead_of_logging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that says itself what was skipped (``checkpoint convert``) uses the store's
    loop through ``passed``: the damaged newer steps, newest first, and the note on
    ``latest``, with nothing logged."""
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / step_dir_name(3) / rank_data_name(0)).unlink()
    (tmp_path / step_dir_name(2) / "rank-00000.json").unlink()
    (tmp_path / "latest").write_text(f"{step_dir_name(4)}\n")
    store = CheckpointStore(tmp_path)
    passed = PassedOver()
    with caplog.at_level("WARNING", logger="checkpoint"), store.open_latest(passed=passed) as r:
        assert r.step == 1
    assert caplog.records == []
    assert list(passed.steps) == [3, 2]
    lines = passed.lines()
    assert lines[0].startswith("step 3: ") and lines[0].endswith("data file missing")
    assert lines[1].startswith("step 2: ") and "rank-00000.json" in lines[1]
    assert passed.latest_note == f"{tmp_path / 'latest'}: names step 4, which is missing"
    with caplog.at_level("WARNING", logger="checkpoint"), store.open_latest() as reader:
        assert reader.step == 1  # without it: logged, as before
    assert [r.getMessage() for r in caplog.records] == [
        passed.latest_note,
        f"skipping checkpoint step 3: {passed.steps[3]}",
        f"skipping checkpoint step 2: {passed.steps[2]}",
    ]


def test_uncommitted_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / step_dir_name(2)).mkdir()
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointIncompleteError, match="never committed"):
        store.open(2)
    with pytest.raises(CheckpointNotFoundError):
        store.open(3)
    assert [i.complete for i in store.list()] == [True, False]
    (tmp_path / "latest").write_text("step-000000000002\n")  # a pointer run ahead
    with store.open_latest() as reader:
        assert reader.step == 1


def test_tampered_rank_manifest_is_caught(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    path = tmp_path / step_dir_name(1) / "rank-00000.json"
    path.write_text(path.read_text().replace('"dp":1', '"dp":2'))
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: SHA-256"):
        CheckpointStore(tmp_path).open(1)


def test_empty_root_has_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        CheckpointStore(tmp_path / "nothing").open_latest()


def _stale_part(root: Path, step: int, rank: int) -> Path:
    """A step directory a crash mid-save left: one rank's part, no MANIFEST.json (``rank``
    not 0, which would wait for the others to commit)."""
    _save(root, step, world=2, ranks=[rank])
    return root / step_dir_name(step)


def test_set_aside_moves_newer_steps_and_repoints_latest(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _save(tmp_path, step)
    _stale_part(tmp_path, 7, rank=1)
    store = CheckpointStore(tmp_path)
    assert store.latest_pointer() == 6

    assert store.set_aside_after(4) == [6, 7]
    assert [i.step for i in store.list()] == [2, 4]
    assert store.abandoned() == [6, 7]
    assert (tmp_path / "abandoned" / step_dir_name(6) / MANIFEST_NAME).is_file()
    assert (tmp_path / "abandoned" / step_dir_name(7) / "rank-00001.json").is_file()
    assert store.latest_pointer() == 4
    assert list(store.candidates()) == [4, 2]
    with store.open_latest() as reader:
        assert reader.step == 4
    with pytest.raises(CheckpointNotFoundError):
        store.open(6)
    assert store.set_aside_after(4) == []  # idempotent


def test_set_aside_replaces_an_older_abandoned_copy(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    _stale_part(tmp_path, 4, rank=1)
    store = CheckpointStore(tmp_path)
    assert store.set_aside_after(2) == [4]
    # the resumed timeline saves step 4 again, fully this time, and is abandoned in turn
    _save(tmp_path, 4)
    assert store.set_aside_after(2) == [4]
    moved = tmp_path / "abandoned" / step_dir_name(4)
    assert (moved / MANIFEST_NAME).is_file()  # the newer copy, not the partial one
    assert not (moved / "rank-00001.json").exists()
    assert store.abandoned() == [4]
    assert store.latest_pointer() == 2


def test_set_aside_before_any_commit_removes_latest(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    _stale_part(tmp_path, 5, rank=1)
    store = CheckpointStore(tmp_path)
    assert store.set_aside_after(-1) == [3, 5]  # a fresh start: everything is newer
    assert store.latest_pointer() is None
    assert store.list() == [] and list(store.candidates()) == []
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        store.open_latest()
    # a new timeline commits step 5 from its own parts only
    _save(tmp_path, 5, world=2)
    with store.open_latest() as reader:
        assert reader.step == 5
        reader.verify()
    assert CheckpointStore(tmp_path / "missing").set_aside_after(0) == []


def test_stale_rank_manifest_would_be_committed_without_set_aside(tmp_path: Path) -> None:
    """The hazard set_aside_after removes: commit takes a leftover part for a peer's."""
    _save(tmp_path, 2, world=2)
    stale = _stale_part(tmp_path, 4, rank=1)
    stale_part = (stale / "rank-00001.json").read_bytes()
    # rank 0 of the resumed timeline saves step 4 and commits at once: rank 1's part
    # is the abandoned timeline's, yet the checkpoint reads as complete
    _save(tmp_path, 4, world=2, ranks=[0], timeout_s=0.5)
    assert (stale / "rank-00001.json").read_bytes() == stale_part
    assert CheckpointStore(tmp_path).latest_pointer() == 4

    fresh = tmp_path / "fresh"
    _save(fresh, 2, world=2)
    _stale_part(fresh, 4, rank=1)
    assert CheckpointStore(fresh).set_aside_after(2) == [4]
    with pytest.raises(CheckpointIncompleteError, match=r"ranks \[1\]"):
        _save(fresh, 4, world=2, ranks=[0], timeout_s=0.3)
    assert CheckpointStore(fresh).latest_pointer() == 2


def test_rank0_commits_only_parts_of_its_own_run(tmp_path: Path) -> None:
    """With run ids, a leftover part of an earlier run is not taken for a peer's new one,
    even where nothing set it aside (a restart that resumed from the newest checkpoint
    after a crash mid-save of the next one)."""
    _save(tmp_path, 2, world=2, run_id="run-a")
    stale = _stale_part(tmp_path, 4, rank=1)  # the crashed run's (no run id) rank 1
    with pytest.raises(CheckpointIncompleteError, match=r"ranks \[1\]"):
        _save(tmp_path, 4, world=2, ranks=[0], timeout_s=0.3, run_id="run-b")
    assert CheckpointStore(tmp_path).latest_pointer() == 2
    # This run's rank 1 replaces the leftover; now rank 0 commits.
    _save(tmp_path, 4, world=2, run_id="run-b")
    assert CheckpointStore(tmp_path).latest_pointer() == 4
    assert '"run_id":"run-b"' in (stale / "rank-00001.json").read_text()
    with CheckpointStore(tmp_path).open(4) as reader:
        reader.verify(deep=True)


def test_a_fenced_out_writer_neither_writes_nor_commits(tmp_path: Path) -> None:
    """A newer run claimed the root (set_aside_after with its run id): a writer of the
    earlier run that is still alive stops before writing, and a commit it was inside
    does not move ``latest``."""
    _save(tmp_path, 2, run_id="run-a")
    _save(tmp_path, 4, run_id="run-a")
    assert CheckpointStore(tmp_path).set_aside_after(2, run_id="run-b") == [4]
    assert read_fence(tmp_path) == "run-b"
    with pytest.raises(CheckpointSupersededError, match="run 'run-b' has taken over"):
        _save(tmp_path, 6, run_id="run-a")
    assert not (tmp_path / step_dir_name(6)).exists()
    with pytest.raises(CheckpointSupersededError, match="not committed"):
        commit(tmp_path, 2, world_size=1, layout={"dp": 1}, timeout_s=1, run_id="run-a")
    assert CheckpointStore(tmp_path).latest_pointer() == 2
    # The new run and writers that name no run (a single-run caller) go on as before.
    _save(tmp_path, 4, run_id="run-b")
    _save(tmp_path, 6)
    assert CheckpointStore(tmp_path).latest_pointer() == 6
    with pytest.raises(ValueError, match="single line"):
        write_fence(tmp_path, "a\nb")


def test_a_commit_waiting_for_parts_stops_when_a_newer_run_claims_the_root(
    tmp_path: Path,
) -> None:
    """An earlier run's rank-0 writer, persisting its last snapshot after its trainer was
    stopped, waits for peers that will never write. Once the next run claims the root it
    gives up at once instead of after ``commit_timeout_s`` (600 s by default)."""
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            _save(tmp_path, 4, world=2, ranks=[0], timeout_s=120, run_id="run-a")
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=rank0)
    waiter.start()
    while not (tmp_path / step_dir_name(4) / "rank-00000.json").exists():
        assert waiter.is_alive(), errors
        time.sleep(0.01)
    write_fence(tmp_path, "run-b")
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the commit kept waiting after the root was claimed"
    assert len(errors) == 1 and isinstance(errors[0], CheckpointSupersededError)
    assert CheckpointStore(tmp_path).latest_pointer() is None
