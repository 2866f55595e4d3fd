"""Stages 3 and 4 for one rank's part: write its data file and manifest, then (rank 0)
commit, apply retention and copy to the mirror tier. No torch here.

The same code runs in a thread of the trainer or in the writer process
(:mod:`checkpoint._backends`); it streams each tensor as soon as the copier reports it
ready, so writing overlaps the device-to-host copy instead of waiting for all of it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint._commit import (
    apply_part_retention,
    apply_retention,
    check_fence,
    check_fences,
    claim_quietly,
    commit,
    join_fence,
    new_rank_manifest,
    write_rank_manifest,
)
from checkpoint._write import (
    BufferFileWriter,
    DataFileWriter,
    aborted_on_error,
    fsync_dir,
    gaps_are_zero,
    tmp_name,
    write_atomic,
)
from checkpoint.errors import CheckpointSupersededError, CheckpointWriteError
from checkpoint.manifest import (
    DEFAULT_CHUNK_BYTES,
    DataFileInfo,
    Entry,
    entry_from_dict,
    plain,
    rank_data_name,
    rank_manifest_name,
    step_dir_name,
)

#: Largest single write; bounded so progress and aborts are noticed between writes.
WRITE_SLICE_BYTES = 16 << 20


@dataclass(kw_only=True, slots=True)
class PersistJob:
    """Everything a writer needs to persist one rank's part of one checkpoint."""

    job_id: int
    root: str
    step: int
    rank: int
    world_size: int
    layout: dict[str, int]
    entries: list[Entry]
    keep_last: int
    commit_timeout_s: float
    sha256: bool = True
    #: Second tier: after the local commit, the same files are copied here and committed.
    mirror_root: str = ""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: Threads computing chunk CRCs beside the writes.
    hash_threads: int = 2
    #: Bulk writes with O_DIRECT (no page-cache copy) where the file system allows it.
    direct_io: bool = True
    #: The run this save belongs to ("" = none); see :mod:`checkpoint._commit` on fences.
    run_id: str = ""
    #: This Checkpointer's first save: rank 0 claims the root for ``run_id`` (the fence),
    #: other ranks wait for that claim (:func:`checkpoint._commit.join_fence`).
    first: bool = False
    #: Entries another rank writes (``stored_by``): listed in the manifest, not written.
    replicas: list[Entry] = field(default_factory=list)
    #: Rank 0 commits in ``root`` (a root all ranks share). False for node-local roots
    #: (``CheckpointConfig.shared_root``): the object store commits; each rank prunes only
    #: its own files of older steps here.
    local_commit: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the writer process (see :func:`checkpoint.manifest.plain`)."""
        out: dict[str, Any] = plain(self)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PersistJob:
        raw = dict(raw)
        raw["entries"] = [entry_from_dict(e) for e in raw["entries"]]
        raw["replicas"] = [entry_from_dict(e) for e in raw.get("replicas", [])]
        return cls(**raw)


@dataclass(kw_only=True, slots=True)
class PersistResult:
    bytes_written: int
    durable_s: float
    committed: bool = False
    commit_s: float = 0.0
    #: Steps retention removed after this save: on rank 0 of a shared root, whole
    #: checkpoints (set before ``on_committed``, which reports them as ``deleted`` events:
    #: the controller must not roll back to one); elsewhere this rank's own files only.
    deleted_steps: list[int] = field(default_factory=list)


def persist_part(
    job: PersistJob,
    buffer: memoryview,
    wait_ready: Callable[[int], bool],
    on_durable: Callable[[PersistResult], None] | None = None,
    on_committed: Callable[[PersistResult], None] | None = None,
) -> PersistResult:
    """Write entries ``0..n-1`` of ``job`` from ``buffer`` and, on rank 0, commit.

    ``wait_ready(i)`` blocks until entry ``i`` is in the buffer; it returns False when the
    snapshot was abandoned (its copy will never finish), and then nothing is committed.
    """
    t0 = time.monotonic()
    root = Path(job.root)
    step_dir = root / step_dir_name(job.step)
    what = f"step {job.step} rank {job.rank}: not written"
    if job.first:  # node-local roots: no rank 0 there, each rank claims its own
        claim = job.rank == 0 or not job.local_commit
        join_fence(root, job.run_id, claim=claim, timeout_s=job.commit_timeout_s, what=what)
        if job.mirror_root and job.rank == 0:  # the mirror's one claimant (see mirror_part)
            claim_quietly(root, job.run_id, job.mirror_root)
    check_fence(root, job.run_id, what)
    step_dir.mkdir(parents=True, exist_ok=True)
    # The new directory's entry in root must be durable before this part counts as durable;
    # that journal commit overlaps the data writes instead of delaying the first one.
    root_synced = _Background(fsync_dir, root)
    data_path = step_dir / rank_data_name(job.rank)
    spans = [(e.offset, e.nbytes) for e in job.entries]
    if gaps_are_zero(buffer, spans):
        info = _write_from_buffer(job, buffer, data_path, wait_ready)
    else:  # a caller that left bytes between tensors: stream entry by entry, pad with zeros
        info = _write_by_entry(job, buffer, data_path, wait_ready)
    _still_ours(job)  # the manifest names this run's data file: never put it beside another's
    write_rank_manifest(
        step_dir,
        new_rank_manifest(
            step=job.step,
            rank=job.rank,
            world_size=job.world_size,
            layout=job.layout,
            data_file=info,
            entries=job.entries + job.replicas,
            run_id=job.run_id,
        ),
    )
    root_synced.result()
    result = PersistResult(bytes_written=info.size_bytes, durable_s=time.monotonic() - t0)
    if on_durable is not None:
        on_durable(result)
    if not job.local_commit:
        result.deleted_steps = apply_part_retention(
            root, job.rank, keep_last=job.keep_last, newest=job.step
        )
    elif job.rank == 0:
        t1 = time.monotonic()
        commit(
            root,
            job.step,
            world_size=job.world_size,
            layout=job.layout,
            timeout_s=job.commit_timeout_s,
            run_id=job.run_id,
        )
        result.committed = True
        result.deleted_steps = apply_retention(
            root, keep_last=job.keep_last, newest_committed=job.step
        )
        result.commit_s = time.monotonic() - t1
        if on_committed is not None:
            on_committed(result)
    if job.mirror_root:
        try:
            mirror_part(job, Path(job.mirror_root))
        except CheckpointSupersededError as exc:  # a zombie: stopped, not a failing mirror
            raise CheckpointSupersededError(
                f"step {job.step} rank {job.rank}: committed locally, not copied to "
                f"{job.mirror_root}: {exc}"
            ) from exc
        except Exception as exc:
            raise CheckpointWriteError(
                f"step {job.step} rank {job.rank}: committed locally, copy to "
                f"{job.mirror_root} failed ({type(exc).__name__}: {exc})"
            ) from exc
    return result


class _Background:
    """Run ``fn(arg)`` on a short-lived thread; :meth:`result` joins and re-raises."""

    def __init__(self, fn: Callable[[Path], None], arg: Path) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, arg), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[Path], None], arg: Path) -> None:
        try:
            fn(arg)
        except BaseException as exc:  # handed to the caller in result()
            self._error = exc

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _abandoned(job: PersistJob, entry: Entry) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"step {job.step} rank {job.rank}: snapshot abandoned before entry {entry.name} was copied"
    )


def _still_ours(job: PersistJob) -> None:
    """Check the fence again right before this part's files replace anything.

    A data file takes seconds to minutes to write; a newer run that claimed the root in
    that time may already have saved (and committed) this step in the same directory.
    Renaming over its files would break its checkpoint's checksums, so an earlier run's
    writer stops here (:class:`CheckpointSupersededError`), and its temp file is removed.
    """
    check_fence(Path(job.root), job.run_id, f"step {job.step} rank {job.rank}: not written")


def _write_from_buffer(
    job: PersistJob, buffer: memoryview, path: Path, wait_ready: Callable[[int], bool]
) -> DataFileInfo:
    """The buffer prefix is the file: write it as the copier makes it final (O_DIRECT,
    parallel chunk CRCs; see :mod:`checkpoint._write`)."""
    writer = BufferFileWriter(
        path,
        buffer,
        chunk_bytes=job.chunk_bytes,
        sha256=job.sha256,
        hash_threads=job.hash_threads,
        direct=job.direct_io,
        size_hint=max((e.offset + e.nbytes for e in job.entries), default=0),
    )
    with aborted_on_error(writer):
        end = 0
        for index, entry in enumerate(job.entries):
            if not wait_ready(index):
                raise _abandoned(job, entry)
            end = entry.offset + entry.nbytes
            writer.advance(end)
        _still_ours(job)
        return writer.finish(end)


def _write_by_entry(
    job: PersistJob, buffer: memoryview, path: Path, wait_ready: Callable[[int], bool]
) -> DataFileInfo:
    writer = DataFileWriter(path, chunk_bytes=job.chunk_bytes, sha256=job.sha256)
    with aborted_on_error(writer):
        for index, entry in enumerate(job.entries):
            if not wait_ready(index):
                raise _abandoned(job, entry)
            writer.pad_to(entry.offset)
            pos = entry.offset
            end = entry.offset + entry.nbytes
            while pos < end:
                nxt = min(end, pos + WRITE_SLICE_BYTES)
                writer.write(buffer[pos:nxt])
                pos = nxt
        _still_ours(job)
        return writer.finish()


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread, inherited by
    the threads it starts). The writer yields the CPU to the training threads: its work
    is latency-tolerant, theirs is not. Failure (no setpriority here) is harmless."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def pin_cpus(cpus: tuple[int, ...] | list[int]) -> None:
    """Run the calling thread (and the threads it starts afterwards) on ``cpus`` only
    (:attr:`CheckpointConfig.writer_cpus`). Empty, or no affinity call here: unchanged."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, set(cpus))  # 0: this thread (Linux affinity is per thread)


def mirror_part(job: PersistJob, mirror: Path) -> None:
    """Copy this rank's committed files to the second tier; rank 0 commits there too.

    The rank manifest is copied byte for byte, so the mirror's MANIFEST.json pins the same
    SHA-256 and the copy is verified by the same CRCs when read.

    The mirror is fenced like the root: rank 0 claims it with the root (restore, first
    save) and every step here re-checks both fences right before it replaces anything.
    A zombie of the previous start (its writer outlives its trainer; its node may be
    partitioned, not dead) would otherwise finish its copy after the new start mirrored
    the same step and rename its files over the new ones, or commit its abandoned step as
    the mirror's newest and let its retention delete the new start's mirrored steps. The
    local root's fence alone cannot stop it when the new start runs on another node's disk.
    """
    fences = (Path(job.root), mirror)
    what = f"{mirror / step_dir_name(job.step)}: not copied"
    if job.first and job.rank != 0:  # wait for rank 0's claim, as on the root
        join_fence(mirror, job.run_id, claim=False, timeout_s=job.commit_timeout_s, what=what)
    check_fences(fences, job.run_id, what)
    src = Path(job.root) / step_dir_name(job.step)
    dst = mirror / step_dir_name(job.step)
    dst.mkdir(parents=True, exist_ok=True)
    fsync_dir(mirror)
    data = src / rank_data_name(job.rank)
    tmp = tmp_name(dst / data.name)
    try:
        with open(data, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, WRITE_SLICE_BYTES)
            fout.flush()
            os.fsync(fout.fileno())
        check_fences(fences, job.run_id, what)  # the copy took seconds to minutes
        os.replace(tmp, dst / data.name)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; a stopped copy's is removed
    manifest = rank_manifest_name(job.rank)
    check_fences(fences, job.run_id, what)
    write_atomic(dst / manifest, (src / manifest).read_bytes())
    if job.rank == 0:
        commit(
            mirror,
            job.step,
            world_size=job.world_size,
            layout=job.layout,
            timeout_s=job.commit_timeout_s,
            run_id=job.run_id,
            fenced_by=(Path(job.root),),
        )
        check_fences(fences, job.run_id, f"{dst}: committed, older steps not removed")
        apply_retention(mirror, keep_last=job.keep_last, newest_committed=job.step)
