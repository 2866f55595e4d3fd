"""The lazy asynchronous checkpoint engine (DataStates-LLM style).

``save(state, step)`` captures the state, copies what may change soon (buffers, loose
tensors, the pickled skeleton) into a reused host buffer, and returns. Parameters and
optimizer state are copied by a background thread while the next forward and backward run;
the optimizer's pre-step hook blocks only if that copy has not finished when the optimizer
is about to modify them. A writer (a separate process by default) streams each tensor to
storage as soon as it is in the buffer, fsyncs, and rank 0 commits.

Training-thread blocking per checkpoint = the time inside ``save`` + time spent in the
pre-step hook waiting for the copy. It is reported in the ``snapshot_done`` event.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint.buffers import HostBuffer, align, reap_stale_buffers
from checkpoint.config import CheckpointConfig
from checkpoint.errors import CheckpointConfigError, CheckpointError, CheckpointWriteError
from checkpoint.manifest import SKELETON_ENTRY, Entry, GlobalMap, Piece, step_dir_name
from checkpoint.restore import Restored, load_state
from checkpoint.snapshot import ShardingHook, capture
from checkpoint.writer import PersistJob
from checkpoint.writers import ProcessWriter, Snapshot, ThreadWriter
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


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the host-buffer view ``dst``.

    Contiguous CPU tensors are copied with one ``memmove`` (ctypes releases the GIL): one
    thread, no dispatcher, no intra-op thread pool. ``Tensor.copy_`` would split a large
    copy over all of torch's threads, and on a small machine those threads then stall the
    training step's own parallel kernels. Anything else (CUDA, strided, conjugated) uses
    ``copy_``.
    """
    if (
        src.device.type == "cpu"
        and src.layout == torch.strided
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and src.numel() == dst.numel()
    ):
        nbytes = src.numel() * src.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)


class _Slot:
    def __init__(self) -> None:
        self.buffer: HostBuffer | None = None
        self.busy = False
        #: (offset, nbytes) of the entries of the last save laid out in this buffer; the
        #: alignment gaps between them are zero, so the buffer prefix is the data file.
        self.spans: list[tuple[int, int]] = []


def _zero_gaps(buf: HostBuffer, spans: list[tuple[int, int]]) -> None:
    """Zero the alignment padding between entries (a new layout in a reused buffer may put
    padding where old tensor bytes lie), so the writer can write the buffer as is."""
    mem = buf.memory()
    pos = 0
    for offset, nbytes in spans:
        if offset > pos:
            mem[pos:offset] = bytes(offset - pos)
        pos = offset + nbytes
    mem.release()


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
        """``run_id``: the same string on every rank of this start of the job, different
        from any earlier start's (the demo job broadcasts a random one). It keeps an earlier
        run's leftovers out of this run's commits and, once this run has claimed the root
        (:meth:`CheckpointStore.set_aside_after`), an earlier run's surviving writer out of
        the root. Empty: neither protection (a single run, or a caller that fences itself)."""
        config.validate()
        if not 0 <= rank < world_size:
            raise CheckpointConfigError(f"rank {rank} outside world size {world_size}")
        self.config = config
        self.root = Path(config.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size = rank, world_size
        self.layout = dict(layout or {"world": world_size})
        self.job = job
        self.run_id = run_id
        self.event_sink = event_sink
        self.sharding = sharding
        self.cond = threading.Condition()
        self._slots = [_Slot() for _ in range(config.num_buffers)]
        self._copying: list[Snapshot] = []
        self._pending: dict[int, Snapshot] = {}
        self._errors: list[str] = []
        self._next_id = 0
        self._hooks: dict[int, Any] = {}
        self._closed = False
        self._copy_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name="ckpt-copier", daemon=True)
        self._copier.start()
        shared = config.writer == "process"
        self._shared = shared
        if shared:
            reap_stale_buffers()
        self._writer: ThreadWriter | ProcessWriter = (
            ProcessWriter(self) if shared else ThreadWriter(self)
        )
        atexit.register(self._at_exit)

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
    def save(self, state: Mapping[str, Any], step: int) -> None:
        """Start checkpoint ``step`` of ``state`` and return as soon as it is safe."""
        if self._closed:
            raise CheckpointConfigError("save() on a closed Checkpointer")
        if step < 0:
            raise CheckpointConfigError(f"step must be >= 0, got {step}")
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
        ordered = [t for t in cap.tensors if not t.lazy] + [t for t in cap.tensors if t.lazy]
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
            _zero_gaps(buf, spans)
            slot.spans = spans
        if cap.skeleton:
            mem = buf.memory()
            mem[: len(cap.skeleton)] = cap.skeleton
            mem.release()
        lazy: list[tuple[int, torch.Tensor, torch.Tensor]] = []
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
        if any(src.is_cuda for _, src, _ in lazy):
            # The side stream must not read a tensor before the kernels queued so far on
            # the trainer's stream (the last optimizer step) have written it.
            snap.cuda_ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            snap.cuda_ready.record()
        job = PersistJob(
            job_id=snap.snap_id,
            root=str(self.root),
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            layout=self.layout,
            entries=entries,
            keep_last=self.config.keep_last,
            commit_timeout_s=self.config.commit_timeout_s,
            mirror_root=str(self.config.mirror_root or ""),
            sha256=self.config.sha256,
            chunk_bytes=self.config.chunk_bytes,
            hash_threads=self.config.hash_threads,
            direct_io=self.config.direct_io,
            run_id=self.run_id,
        )
        with self.cond:
            self._pending[snap.snap_id] = snap
            if lazy:
                self._copying.append(snap)
        snap.blocking_s = time.monotonic() - t0
        if not lazy:
            snap.copy_done.set()
            self.emit("snapshot_done", step, blocking_s=snap.blocking_s, size_bytes=offset)
        try:
            self._writer_for_save().submit(snap, job)
        except CheckpointWriteError as exc:  # the training loop goes on without this one
            with self.cond:
                snap.aborted = True
                self.cond.notify_all()
            snap.copy_done.set()
            self.on_failed(snap, str(exc))
            self.on_done(snap)
            return
        if lazy:
            self._copy_q.put(snap)

    def _writer_for_save(self) -> ThreadWriter | ProcessWriter:
        """The writer, restarted if its process died (OOM killer, a stray kill)."""
        if not self._writer.alive():
            log.warning("checkpoint writer process exited; starting a new one")
            self._writer.close()
            self._writer = ProcessWriter(self) if self._shared else ThreadWriter(self)
        return self._writer

    def _acquire_slot(self, size_bytes: int) -> _Slot:
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

    # ------------------------------------------------------------------ copier
    def _copy_loop(self) -> None:
        stream = None
        if torch.cuda.is_available():
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        while True:
            snap = self._copy_q.get()
            if snap is None:
                return
            try:
                if stream is not None and snap.cuda_ready is not None:
                    stream.wait_event(snap.cuda_ready)
                since = 0
                last = len(snap.lazy) - 1
                for n, (index, src, dst) in enumerate(snap.lazy):
                    if stream is not None and src.is_cuda:
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                    else:
                        copy_tensor(dst, src)
                    since += dst.numel() * dst.element_size()
                    if since >= self.config.copy_slice_bytes or n == last:
                        if stream is not None:
                            stream.synchronize()
                        since = 0
                        if n == last:
                            self._report_snapshot_done(snap)
                        with self.cond:
                            snap.ready = index + 1
                            self.cond.notify_all()
                        self._writer.progress(snap)
            except Exception as exc:
                log.exception("checkpoint copy of step %d failed", snap.step)
                with self.cond:
                    snap.aborted = True
                    snap.error = f"copy failed: {exc}"
                    self.cond.notify_all()
                self.emit("failed", snap.step, error=snap.error[:1000])
                with contextlib.suppress(CheckpointWriteError):  # writer may be gone too
                    self._writer.abort(snap)
            finally:
                snap.copy_done.set()

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
    def _pre_step(self, *_: Any) -> None:
        self.wait_for_copies()

    def wait_for_copies(self) -> None:
        """Block until every snapshot's host copy is complete (the pre-step hook)."""
        with self.cond:
            copying = list(self._copying)
            self._copying.clear()
        for snap in copying:
            with self.cond:
                if snap.copy_done.is_set():
                    continue
                snap.waiting_since = time.monotonic()
            snap.copy_done.wait()

    # ------------------------------------------------------------------ writer callbacks
    def on_durable(self, snap: Snapshot, size_bytes: int) -> None:
        snap.durable_s = time.monotonic() - snap.t0
        self.emit("durable", snap.step, size_bytes=size_bytes, duration_s=snap.durable_s)

    def on_committed(self, snap: Snapshot) -> None:
        self.emit("committed", snap.step, duration_s=time.monotonic() - snap.t0)

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
            self.cond.notify_all()

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
        """Restore ``state`` in place from ``step`` (default: newest complete checkpoint)."""
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
            self._copy_q.put(None)
            self._copier.join()
            self._writer.close()
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
