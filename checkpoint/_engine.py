"""The lazy asynchronous checkpoint engine (DataStates-LLM style): :class:`Checkpointer`.

A save runs four stages, one module each:

1. *snapshot* (:mod:`checkpoint._snapshot`, on the training thread): walk the state into
   tensors and a pickled skeleton;
2. *stage to host* (:mod:`checkpoint._stage`): copy what may change soon (buffers, loose
   tensors, the skeleton) at once, and parameters and optimizer state on the copier thread
   while the next forward and backward run; the optimizer's pre-step hook blocks only if it
   would overwrite a tensor not yet copied;
3. *write* (:mod:`checkpoint._write`, driven by :mod:`checkpoint._persist` on a writer
   thread or process, :mod:`checkpoint._backends`): stream each tensor to the data file as
   soon as it is in the buffer, fsync;
4. *commit* (:mod:`checkpoint._commit`): rank 0 writes ``MANIFEST.json`` and moves
   ``latest``.

Training-thread blocking per checkpoint = the time inside ``save`` + time spent in the
pre-step hook waiting for the copy. It is reported in the ``snapshot_done`` event. A save
that comes due while the previous one is still being written is skipped or coalesced
(:attr:`CheckpointConfig.when_busy`), so training never waits on storage.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint._backends import ProcessWriter, ThreadWriter
from checkpoint._commit import claim_quietly
from checkpoint._dedup import Shared, plan_writers
from checkpoint._load import Restored, load_state
from checkpoint._persist import PersistJob
from checkpoint._runid import launcher_run_id
from checkpoint._snapshot import CapturedTensor, ShardingHook, capture, optimizer_storages
from checkpoint._stage import (
    Copier,
    HostBuffer,
    LazyCopy,
    Slot,
    Snapshot,
    align,
    copy_tensor,
    guard_positions,
    reap_stale_buffers,
    record_source_events,
    wait_guard,
    zero_gaps,
)
from checkpoint._tier import TierUploader
from checkpoint._tier_restore import load_nearest
from checkpoint.config import CheckpointConfig
from checkpoint.errors import CheckpointConfigError, CheckpointError, CheckpointWriteError
from checkpoint.manifest import SKELETON_ENTRY, Entry, GlobalMap, Piece, step_dir_name
from trainguard.wire import CheckpointEvent

log = logging.getLogger(__name__)

EventSink = Callable[[CheckpointEvent], None]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _identity_map(name: str, tensor: torch.Tensor) -> GlobalMap:
    shape = list(tensor.shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    piece = Piece(offsets=[0] * len(shape), shape=shape, base=0, strides=strides)
    return GlobalMap(name=name, shape=shape, placement="shard", pieces=[piece])


class Checkpointer:
    """One rank's checkpoint engine. Use one per process; close it (or use ``with``)."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        layout: Mapping[str, int] | None = None,
        job: str = "local",
        event_sink: EventSink | None = None,
        sharding: ShardingHook | None = None,
        run_id: str = "",
    ) -> None:
        """``run_id``: one per start of the job, the same on every rank; default: from the
        launcher (``_runid.launcher_run_id``: a multi-node torchrun's ranks must all make one,
        for one broadcast). Keeps earlier runs' leftovers and zombie writers out; "": no fence."""
        config.validate()
        if not 0 <= rank < world_size:
            raise CheckpointConfigError(f"rank {rank} outside world size {world_size}")
        self.config = config
        self.root = Path(config.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in its place, no permission: the caller's setting
            why = exc.strerror or type(exc).__name__
            raise CheckpointConfigError(f"checkpoint root {self.root}: {why}") from exc
        self.rank, self.world_size = rank, world_size
        self.layout = dict(layout or {"world": world_size})
        self.job = job
        self.run_id = run_id or launcher_run_id(self.root)
        self.event_sink = event_sink
        self.sharding = sharding
        self.cond = threading.Condition()
        #: Saves not taken because the previous one was still being written (``skip``).
        self.saves_skipped = 0
        #: Saves dropped because a newer one replaced them before writing (``coalesce``).
        self.saves_coalesced = 0
        #: Size of this rank's data file for the last save taken (replicas written by other
        #: ranks excluded, see ``CheckpointConfig.dedup_replicas``).
        self.last_save_bytes = 0
        self._slots = [Slot() for _ in range(config.num_buffers)]
        self._copying: list[Snapshot] = []
        self._pending: dict[int, Snapshot] = {}
        #: ``coalesce``: a staged save held back until the one being written is done.
        self._held: tuple[Snapshot, PersistJob] | None = None
        self._errors: list[str] = []
        self._next_id = 0
        self._hooks: dict[int, Any] = {}
        #: ``save`` start (monotonic) of the steps queued for upload, for ``uploaded`` events.
        self._upload_t0: dict[int, float] = {}
        self._closed = False
        self._copier = Copier(
            cond=self.cond,
            slice_bytes=config.copy_slice_bytes,
            on_progress=self._on_copy_progress,
            on_copied=self._report_snapshot_done,
            on_failed=self._on_copy_failed,
            cpus=config.writer_cpus,
        )
        self._shared = config.writer == "process"
        if self._shared:
            reap_stale_buffers()
        self._writer = self._new_writer()
        #: The object-storage tier's uploader: every rank sends its own files (``_tier``).
        self.uploader: TierUploader | None = None
        if config.object_store is not None:
            self.uploader = TierUploader(
                self.root,
                config.object_store,
                rank=rank,
                world_size=world_size,
                on_state=self._on_upload_state,
                local_commit=config.shared_root,
            )
        atexit.register(self._at_exit)

    def _new_writer(self) -> ThreadWriter | ProcessWriter:
        kind = ProcessWriter if self._shared else ThreadWriter
        return kind(self, nice=self.config.writer_nice, cpus=self.config.writer_cpus)

    # ------------------------------------------------------------------ events
    def emit(self, kind: str, step: int, **fields: Any) -> None:
        if self.event_sink is None:
            return
        try:
            event = CheckpointEvent(
                job=self.job,
                rank=self.rank,
                step=step,
                kind=kind,
                time_unix_s=time.time(),
                path=str(self.root / step_dir_name(step)),
                **fields,
            )
            self.event_sink(event)
        except Exception:  # instrumentation never breaks training
            log.exception("checkpoint event sink failed")

    # ------------------------------------------------------------------ save
    def busy(self) -> bool:
        """A save is still being staged or written."""
        with self.cond:
            return bool(self._pending)

    def save(self, state: Mapping[str, Any], step: int, *, required: bool = False) -> bool:
        """Start checkpoint ``step`` of ``state`` and return as soon as it is safe.

        Returns False when the save was not taken: the previous one is still being written
        and :attr:`CheckpointConfig.when_busy` is ``skip`` (counted in
        :attr:`saves_skipped`). ``required=True`` (a final or protective checkpoint) waits
        for a host buffer instead, and under ``coalesce`` drops a held-back older save.
        """
        if self._closed:
            raise CheckpointConfigError("save() on a closed Checkpointer")
        if step < 0:
            raise CheckpointConfigError(f"step must be >= 0, got {step}")
        policy = self.config.when_busy
        dropped: Snapshot | None = None
        with self.cond:
            busy = bool(self._pending)
            if busy and policy == "skip" and not required:
                self.saves_skipped += 1
                log.info("checkpoint step %d skipped: the previous save is still in flight", step)
                return False
            if policy == "coalesce" and self._held is not None:
                dropped = self._held[0]
                self._held = None
                self._pending.pop(dropped.snap_id, None)
                self.saves_coalesced += 1
        if dropped is not None:
            self._release(dropped)
            log.info("checkpoint step %d replaced by step %d before writing", dropped.step, step)
        hold = busy and policy == "coalesce" and not required
        self._stage(state, step, hold=hold)
        return True

    def skip(self, step: int) -> None:
        """Count a save the caller decided not to take (a job whose ranks agreed that one of
        them is :meth:`busy`), so :attr:`saves_skipped` covers both ways of skipping."""
        with self.cond:
            self.saves_skipped += 1
        log.info("checkpoint step %d skipped: a save is still in flight", step)

    def _release(self, snap: Snapshot) -> None:
        snap.copy_done.wait()
        with self.cond:
            snap.slot.busy = False
            self.cond.notify_all()

    def _stage(self, state: Mapping[str, Any], step: int, *, hold: bool) -> None:
        t0 = time.monotonic()
        self.emit("started", step)
        self.wait_for_copies()
        sharding = self.sharding
        if sharding is None and self.world_size == 1:
            sharding = lambda name, t: (t, _identity_map(name, t))  # noqa: E731
        cap = capture(state, include_rng=self.config.include_rng, sharding=sharding)
        for t in cap.tensors:
            if t.tensor.is_sparse or t.tensor.device.type == "meta":
                raise CheckpointConfigError(f"tensor {t.name}: sparse/meta tensors unsupported")
        writers = self._plan_writers(cap.tensors)
        own = [t for t in cap.tensors if writers.get(t.name, self.rank) == self.rank]
        replicas = [
            Entry(
                name=t.name,
                dtype=_dtype_name(t.tensor.dtype),
                shape=list(t.tensor.shape),
                offset=0,
                nbytes=t.tensor.numel() * t.tensor.element_size(),
                global_map=t.global_map,
                stored_by=writers[t.name],
            )
            for t in cap.tensors
            if writers.get(t.name, self.rank) != self.rank
        ]
        ordered = [t for t in own if not t.lazy] + [t for t in own if t.lazy]
        entries = [
            Entry(
                name=SKELETON_ENTRY,
                dtype="uint8",
                shape=[len(cap.skeleton)],
                offset=0,
                nbytes=len(cap.skeleton),
            )
        ]
        offset = align(len(cap.skeleton))
        for t in ordered:
            nbytes = t.tensor.numel() * t.tensor.element_size()
            entries.append(
                Entry(
                    name=t.name,
                    dtype=_dtype_name(t.tensor.dtype),
                    shape=list(t.tensor.shape),
                    offset=offset,
                    nbytes=nbytes,
                    global_map=t.global_map,
                )
            )
            offset = align(offset + nbytes)
        slot = self._acquire_slot(offset)
        buf = slot.buffer
        assert buf is not None
        spans = [(e.offset, e.nbytes) for e in entries]
        if spans != slot.spans:
            zero_gaps(buf, spans)
            slot.spans = spans
        if cap.skeleton:
            mem = buf.memory()
            mem[: len(cap.skeleton)] = cap.skeleton
            mem.release()
        lazy: list[LazyCopy] = []
        for index, (t, entry) in enumerate(zip(ordered, entries[1:], strict=True), start=1):
            dst = buf.view(entry.offset, entry.nbytes, t.tensor.dtype, entry.shape)
            if t.lazy:
                lazy.append((index, t.tensor, dst))
            else:
                copy_tensor(dst, t.tensor)
        for opt in cap.optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._pre_step)
        self._next_id += 1
        snap = Snapshot(
            snap_id=self._next_id,
            step=step,
            slot=slot,
            buffer=buf,
            lazy=lazy,
            ready=len(entries) - len(lazy),
            t0=t0,
            total_bytes=offset,
        )
        if lazy:
            snap.guards = guard_positions(
                lazy, {id(opt): optimizer_storages(opt) for opt in cap.optimizers}
            )
            record_source_events(snap)
        job = self._job(snap, entries)
        job.replicas = replicas
        self.last_save_bytes = offset
        with self.cond:
            self._pending[snap.snap_id] = snap
            if lazy:
                self._copying.append(snap)
            if hold and any(s is not snap for s in self._pending.values()):
                self._held = (snap, job)
            else:
                hold = False  # the save in flight finished meanwhile: write this one now
        snap.blocking_s = time.monotonic() - t0
        if not lazy:
            snap.queued.set()
            snap.copy_done.set()
            self.emit("snapshot_done", step, blocking_s=snap.blocking_s, size_bytes=offset)
        if hold and lazy:
            self._copier.submit(snap)
        elif not hold:  # the writer first: its syscalls before the copier wants the GIL
            self._submit(snap, job, start_copy=bool(lazy))

    def _plan_writers(self, tensors: list[CapturedTensor]) -> dict[str, int]:
        """Which rank writes each tensor shared with data-parallel replicas (``_dedup``)."""
        if not self.config.dedup_replicas or self.world_size == 1:
            return {}
        shared = [
            Shared(t.name, t.tensor.numel() * t.tensor.element_size(), t.replicas)
            for t in tensors
            if len(t.replicas) > 1
            and self.rank in t.replicas
            and all(0 <= r < self.world_size for r in t.replicas)
        ]
        return plan_writers(shared)

    def _job(self, snap: Snapshot, entries: list[Entry]) -> PersistJob:
        cfg = self.config
        return PersistJob(
            job_id=snap.snap_id,
            root=str(self.root),
            step=snap.step,
            rank=self.rank,
            world_size=self.world_size,
            layout=self.layout,
            entries=entries,
            keep_last=cfg.keep_last,
            commit_timeout_s=cfg.commit_timeout_s,
            mirror_root=str(cfg.mirror_root or ""),
            sha256=cfg.sha256,
            chunk_bytes=cfg.chunk_bytes,
            hash_threads=cfg.hash_threads,
            direct_io=cfg.direct_io,
            run_id=self.run_id,
            first=snap.snap_id == 1,
            local_commit=cfg.shared_root,
        )

    def _submit(self, snap: Snapshot, job: PersistJob, *, start_copy: bool = False) -> None:
        """Hand ``job`` to the writer; ``start_copy``: then start the lazy copy (after, so
        that the training thread's pipe write and ``waitpid`` do not compete for the GIL
        with the copier)."""
        try:
            self._writer_for_save().submit(snap, job)
        except CheckpointWriteError as exc:  # the training loop goes on without this one
            with self.cond:
                snap.aborted = True
                self.cond.notify_all()
            if start_copy:  # on_done waits for the copy to end
                self._copier.submit(snap)
            self.on_failed(snap, str(exc))
            self.on_done(snap)
            return
        if start_copy:
            self._copier.submit(snap)

    def _writer_for_save(self) -> ThreadWriter | ProcessWriter:
        """The writer, restarted if its process died (OOM killer, a stray kill)."""
        if not self._writer.alive():
            log.warning("checkpoint writer process exited; starting a new one")
            self._writer.close()
            self._writer = self._new_writer()
        return self._writer

    def _acquire_slot(self, size_bytes: int) -> Slot:
        with self.cond:
            while True:
                free = [s for s in self._slots if not s.busy]
                if free:
                    break
                self.cond.wait()
            slot = free[0]
            slot.busy = True
        if slot.buffer is None or slot.buffer.size_bytes < size_bytes:
            if slot.buffer is not None:
                with contextlib.suppress(CheckpointWriteError):  # a dead writer forgets anyway
                    self._writer.forget_buffer(slot.buffer)
                slot.buffer.close()
            slot.buffer = HostBuffer(size_bytes, shared=self._shared, pin=True)
            slot.spans = []  # a fresh map is all zeros, but say nothing about its layout
        return slot

    # ------------------------------------------------------------------ copier callbacks
    def _on_copy_progress(self, snap: Snapshot) -> None:
        if self._held is not None and self._held[0] is snap:
            return  # not handed to a writer yet; it will find the copy done
        with contextlib.suppress(CheckpointWriteError):  # a dead writer fails the save itself
            self._writer.progress(snap)

    def _on_copy_failed(self, snap: Snapshot, error: str) -> None:
        log.error("checkpoint copy of step %d failed: %s", snap.step, error)
        self.emit("failed", snap.step, error=error[:1000])
        with contextlib.suppress(CheckpointWriteError):  # writer may be gone too
            self._writer.abort(snap)

    def _report_snapshot_done(self, snap: Snapshot) -> None:
        """Runs on the copier right before the copy is declared done, so that the event
        precedes ``durable`` and counts the time the trainer has spent waiting in the hook."""
        with self.cond:
            if snap.waiting_since is not None:
                snap.blocking_s += time.monotonic() - snap.waiting_since
                snap.waiting_since = None
            blocking = snap.blocking_s
        self.emit("snapshot_done", snap.step, blocking_s=blocking, size_bytes=snap.total_bytes)

    def wait_ready(self, snap: Snapshot, index: int) -> bool:
        with self.cond:
            while snap.ready <= index and not snap.aborted:
                self.cond.wait()
            return not snap.aborted

    # ------------------------------------------------------------------ blocking points
    def _pre_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        """Before ``opt.step()``: wait only for copies of tensors this optimizer writes."""
        with self.cond:
            self._copying = copying = [s for s in self._copying if not s.copy_done.is_set()]
        for snap in copying:
            wait_guard(self.cond, snap, id(opt))

    def wait_for_copies(self) -> None:
        """Block until every snapshot's host copy is complete."""
        with self.cond:
            copying = list(self._copying)
            self._copying.clear()
        for snap in copying:
            with self.cond:
                if snap.copy_done.is_set():
                    continue
                if snap.waiting_since is None:
                    snap.waiting_since = time.monotonic()
            snap.copy_done.wait()

    # ------------------------------------------------------------------ writer callbacks
    def on_durable(self, snap: Snapshot, size_bytes: int) -> None:
        snap.durable_s = time.monotonic() - snap.t0
        self.emit("durable", snap.step, size_bytes=size_bytes, duration_s=snap.durable_s)
        # Rank 0 of a shared root queues at its commit; with node-local roots, no rank commits.
        if self.uploader is not None and (self.rank != 0 or not self.config.shared_root):
            self._queue_upload(snap.step, snap.t0)

    def on_committed(self, snap: Snapshot, deleted: list[int]) -> None:
        """``deleted`` follows the commit: a rollback must not be sent to a removed step."""
        self.emit("committed", snap.step, duration_s=time.monotonic() - snap.t0)
        for step in deleted:
            self.emit("deleted", step)
        if self.uploader is not None:
            self._queue_upload(snap.step, snap.t0)

    def _on_upload_state(self, step: int, state: str, error: str) -> None:
        """The object-store tier's progress as ``CheckpointEvent`` s (``tier=object_store``);
        ``uploaded`` carries the time from ``save`` to the step being in the bucket, and so
        does ``committed`` (node-local roots: rank 0's remote commit, just before)."""
        with self.cond:
            t0 = self._upload_t0.get(step)
            if state in ("uploaded", "upload_failed"):
                self._upload_t0.pop(step, None)
        since = None if t0 is None else time.monotonic() - t0
        duration = since if state in ("uploaded", "committed") else None
        self.emit(state, step, tier="object_store", duration_s=duration, error=error[:1000])

    def _queue_upload(self, step: int, t0: float | None = None) -> None:
        assert self.uploader is not None
        if t0 is not None:
            with self.cond:
                self._upload_t0[step] = t0
        try:  # hard links and a queue entry; the upload runs on the uploader's thread
            self.uploader.submit(step)
        except Exception as exc:  # the local tier stands; the next save uploads
            log.error("checkpoint step %d: not queued for upload: %s", step, exc)

    def on_failed(self, snap: Snapshot, error: str) -> None:
        log.error("checkpoint step %d failed: %s", snap.step, error)
        with self.cond:
            self._errors.append(f"step {snap.step}: {error}")
        self.emit("failed", snap.step, error=error[:1000])

    def on_done(self, snap: Snapshot) -> None:
        snap.copy_done.wait()  # a writer that failed early must not free a buffer in use
        with self.cond:
            snap.slot.busy = False
            self._pending.pop(snap.snap_id, None)
            held = self._held
            if held is not None and len(self._pending) == 1:  # only the held one is left
                self._held = None
            else:
                held = None
            self.cond.notify_all()
        if held is not None:
            self._submit(*held)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until every save so far is durable (and committed on rank 0).

        Raises :class:`CheckpointWriteError` listing the saves that failed since the last
        ``wait``.
        """
        self.wait_for_copies()
        with self.cond:
            while self._pending:
                if not self._writer.alive():
                    self._errors.append("writer died")
                    break
                self.cond.wait(timeout=1.0)
            errors, self._errors = self._errors, []
        if errors:
            raise CheckpointWriteError("; ".join(errors))

    def load(self, state: Mapping[str, Any], *, step: int | None = None) -> Restored:
        """Restore ``state`` in place from ``step`` (default: newest complete checkpoint).

        With an ``object_store`` the nearest good copy is used: local first, then the
        bucket's (downloaded and checksummed), newest step first."""
        if self.rank == 0 or not self.config.shared_root:  # this run takes over the root
            claim_quietly(self.root, self.run_id, None if self.rank else self.config.mirror_root)
        if self.config.object_store is not None:
            restored, choice = load_nearest(
                self.root,
                self.config.object_store,
                lambda s: load_state(
                    self.root, state, rank=self.rank, step=s, restore_rng=self.config.include_rng
                ),
                step=step,
                client=self.uploader.client if self.uploader is not None else None,
            )
            restored.source = choice.source
            restored.skipped = choice.skipped + restored.skipped
            return restored
        return load_state(
            self.root, state, rank=self.rank, step=step, restore_rng=self.config.include_rng
        )

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._copier.close()
            self._writer.close()
            if self.uploader is not None:  # the last checkpoint reaches the bucket too
                self.uploader.close()
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            for slot in self._slots:
                if slot.buffer is not None:
                    slot.buffer.close()
                    slot.buffer = None
            atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        try:
            self.close()
        except CheckpointError as exc:
            log.error("checkpoint flush at exit: %s", exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
