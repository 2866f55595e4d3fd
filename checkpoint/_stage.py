"""Stage 2 of a save, *stage to host*: copy the captured tensors into a reused host buffer.

Host buffers are memory maps: anonymous for the thread writer, a file in ``/dev/shm`` for
the writer process so that both processes see the same pages without a copy, and so that
the writer still holds the snapshot if the trainer is killed (persist-at-breakpoint). With
CUDA the pages are registered as pinned memory (once per buffer, and buffers are reused
across saves) so device-to-host copies run asynchronously at full PCIe bandwidth.

The :class:`Copier` thread copies the *lazy* tensors (parameters, optimizer state) while
the next forward/backward runs. For a CUDA source it makes the source's device current in
its own thread (``torch.cuda.device``: a new thread starts on device 0, and a stream or
event made there would order nothing on ``cuda:LOCAL_RANK``), copies on a side stream of
that device after an event recorded on the trainer's stream at ``save`` (so it reads what
the last optimizer step wrote), and records a *copied* event per device. The optimizer's
pre-step hook (:meth:`Snapshot.guard`) waits only when that optimizer would overwrite a
tensor not yet copied: on CPU until the copier has passed its last tensor, on CUDA only
until the copies are queued; then the trainer's stream waits on the copied event, so the
host thread does not block on the transfer at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint.manifest import ENTRY_ALIGN_BYTES

#: The reader refuses other tensor offsets (:func:`checkpoint._validate._check_layout`).
ALIGN_BYTES = ENTRY_ALIGN_BYTES


def align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


PREFIX = "trainguard-ckpt-"


def reap_stale_buffers(directory: Path | None = None) -> list[Path]:
    """Remove shared buffers left by trainers that no longer exist (killed before cleanup).

    Safe even while a writer process still persists from such a buffer: it holds a mapping,
    and unlinking a name does not unmap it.
    """
    removed = []
    folder = directory or _shm_dir()
    for path in folder.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        except PermissionError:
            pass  # alive, someone else's
    return removed


class HostBuffer:
    """One reusable host buffer of ``size_bytes``; ``view`` gives a typed slice of it."""

    def __init__(self, size_bytes: int, *, shared: bool, pin: bool) -> None:
        self.size_bytes = max(ALIGN_BYTES, align(size_bytes))
        self.path: Path | None = None
        if shared:
            self.path = _shm_dir() / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.size_bytes)
                self._mm = mmap.mmap(fd, self.size_bytes)
            finally:
                os.close(fd)
        else:
            self._mm = mmap.mmap(-1, self.size_bytes)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr(), self.size_bytes, 0
            )
            self.pinned = int(rc) == 0

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A typed view of ``[offset, offset + nbytes)``, made once per layout: the same
        state saved again asks for the same views, and three tensor ops per tensor per
        save are training-thread time."""
        key = (offset, nbytes, dtype, *shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 65536:  # a state whose layout keeps changing
                self._views.clear()
            view = self._views[key] = self.tensor[offset : offset + nbytes].view(dtype).view(shape)
        return view

    def memory(self) -> memoryview:
        return memoryview(self._mm)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr()
            )
            self.pinned = False
        self._views.clear()
        del self.tensor
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class Slot:
    """One host buffer and what the engine knows about its current contents."""

    def __init__(self) -> None:
        self.buffer: HostBuffer | None = None
        self.busy = False
        #: (offset, nbytes) of the entries of the last save laid out in this buffer; the
        #: alignment gaps between them are zero, so the buffer prefix is the data file.
        self.spans: list[tuple[int, int]] = []


def zero_gaps(buf: HostBuffer, spans: list[tuple[int, int]]) -> None:
    """Zero the alignment padding between entries (a new layout in a reused buffer may put
    padding where old tensor bytes lie), so the writer can write the buffer as is."""
    mem = buf.memory()
    pos = 0
    for offset, nbytes in spans:
        if offset > pos:
            mem[pos:offset] = bytes(offset - pos)
        pos = offset + nbytes
    mem.release()


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the host-buffer view ``dst`` (CPU sources).

    Contiguous CPU tensors are copied with one ``memmove`` (ctypes releases the GIL): one
    thread, no dispatcher, no intra-op thread pool. ``Tensor.copy_`` would split a large
    copy over all of torch's threads, and on a small machine those threads then stall the
    training step's own parallel kernels. Anything else (strided, conjugated) uses ``copy_``.
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


def copy_device(device: torch.device, current: int = 0) -> torch.device | None:
    """The CUDA device the copier must make current to copy from ``device``; ``None`` for a
    host source (copied synchronously with :func:`copy_tensor`).

    Pure so that it is tested without a GPU: ``cuda:1`` gives ``cuda:1`` (never the thread's
    default device 0), an index-less ``cuda`` the trainer's ``current`` device.
    """
    if device.type != "cuda":
        return None
    return torch.device("cuda", current if device.index is None else device.index)


def source_devices(sources: Iterable[torch.Tensor], current: int = 0) -> list[torch.device]:
    """Distinct CUDA devices among ``sources``, in first-seen order (one side stream and one
    ready/copied event pair each)."""
    seen: list[torch.device] = []
    for src in sources:
        dev = copy_device(src.device, current)
        if dev is not None and dev not in seen:
            seen.append(dev)
    return seen


def slice_ends(nbytes: Sequence[int], slice_bytes: int) -> list[int]:
    """Positions (exclusive, in the lazy list) after which the copier reports progress:
    every ``slice_bytes`` copied, and after the last tensor."""
    ends, since = [], 0
    for n, size in enumerate(nbytes):
        since += size
        if since >= slice_bytes or n == len(nbytes) - 1:
            ends.append(n + 1)
            since = 0
    return ends


#: (entry index, source tensor, host-buffer view) of one tensor the copier copies.
LazyCopy = tuple[int, torch.Tensor, torch.Tensor]


@dataclass(kw_only=True, slots=True, eq=False)
class Snapshot:
    """One save in flight on this rank, from ``save`` until its writer is done."""

    snap_id: int
    step: int
    slot: Slot
    buffer: HostBuffer
    lazy: list[LazyCopy]
    #: Entries ``[0, ready)`` are final in the buffer (the writer may write them).
    ready: int
    t0: float
    total_bytes: int
    copy_done: threading.Event = field(default_factory=threading.Event)
    #: Set once every lazy copy is queued (CPU: done); ``copied`` then holds its events.
    queued: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    error: str = ""
    blocking_s: float = 0.0
    #: Set while the training thread waits for this copy (the copier adds the wait up).
    waiting_since: float | None = None
    #: CUDA events recorded on the trainer's stream of each source device at ``save``.
    source_ready: dict[torch.device, Any] = field(default_factory=dict)
    #: CUDA events recorded on the copier's stream of each device after the last copy.
    copied: dict[torch.device, Any] = field(default_factory=dict)
    #: Per optimizer (``id``): the last position in ``lazy`` holding one of its tensors.
    guards: dict[int, int] = field(default_factory=dict)
    #: Lazy copies done (host bytes final), the copier's progress in ``lazy``.
    copied_upto: int = 0
    durable_s: float = 0.0


def record_source_events(snap: Snapshot) -> None:
    """At ``save``, on the training thread: one event per source device on its current
    stream, so the copier's stream reads the tensors only after the queued kernels (the last
    optimizer step) have written them."""
    if not torch.cuda.is_available():
        return
    for dev in source_devices(src for _, src, _ in snap.lazy):
        with torch.cuda.device(dev):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(dev))
        snap.source_ready[dev] = event


class Copier:
    """The background thread that stages lazy tensors into host buffers (module docstring).

    ``cond`` is the engine's condition; ``on_progress(snap)`` runs after each slice is final
    in host memory (the writer may go on), ``on_copied(snap)`` right before the last
    progress report, ``on_failed(snap, error)`` when a copy raised.
    """

    def __init__(
        self,
        *,
        cond: threading.Condition,
        slice_bytes: int,
        on_progress: Callable[[Snapshot], None],
        on_copied: Callable[[Snapshot], None],
        on_failed: Callable[[Snapshot, str], None],
        cpus: tuple[int, ...] = (),
    ) -> None:
        self.cond = cond
        self._cpus = cpus
        self.slice_bytes = slice_bytes
        self._on_progress, self._on_copied, self._on_failed = on_progress, on_copied, on_failed
        self._streams: dict[torch.device, Any] = {}
        self._q: list[Snapshot | None] = []
        self._q_cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ckpt-copier", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        with self._q_cond:
            self._q.append(snap)
            self._q_cond.notify()

    def close(self) -> None:
        with self._q_cond:
            self._q.append(None)
            self._q_cond.notify()
        self._thread.join()

    def _stream(self, dev: torch.device) -> Any:
        stream = self._streams.get(dev)
        if stream is None:
            with torch.cuda.device(dev):  # a stream of the source's device, not of device 0
                stream = self._streams[dev] = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        return stream

    def _loop(self) -> None:
        if self._cpus and hasattr(os, "sched_setaffinity"):  # CheckpointConfig.writer_cpus
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, set(self._cpus))
        while True:
            with self._q_cond:
                while not self._q:
                    self._q_cond.wait()
                snap = self._q.pop(0)
            if snap is None:
                return
            try:
                self._copy(snap)
            except Exception as exc:
                with self.cond:
                    snap.aborted = True
                    snap.error = f"copy failed: {type(exc).__name__}: {exc}"
                    self.cond.notify_all()
                self._on_failed(snap, snap.error)
            finally:
                snap.queued.set()
                snap.copy_done.set()
                with self.cond:
                    self.cond.notify_all()

    def _copy(self, snap: Snapshot) -> None:
        """Queue every copy (CPU ones complete at once), then report slices in order as
        their bytes become final in host memory."""
        lazy = snap.lazy
        ends = slice_ends(
            [dst.numel() * dst.element_size() for _, _, dst in lazy], self.slice_bytes
        )
        waited: set[torch.device] = set()
        pending: list[tuple[int, dict[torch.device, Any]]] = []  # slices behind CUDA events
        start = 0
        for end in ends:
            events: dict[torch.device, Any] = {}
            for _, src, dst in lazy[start:end]:
                dev = copy_device(src.device)
                if dev is None:
                    copy_tensor(dst, src)
                    continue
                stream = self._stream(dev)
                with torch.cuda.device(dev), torch.cuda.stream(stream):
                    if dev not in waited and dev in snap.source_ready:
                        stream.wait_event(snap.source_ready[dev])
                    waited.add(dev)
                    dst.copy_(src, non_blocking=True)
                events[dev] = None
            for dev in events:
                with torch.cuda.device(dev):
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(self._stream(dev))
                events[dev] = event
                snap.copied[dev] = event
            if events or pending:
                pending.append((end, events))  # in order: the writer needs a prefix
            else:
                self._report(snap, end)
            start = end
        snap.queued.set()
        with self.cond:
            self.cond.notify_all()
        for end, events in pending:
            for event in events.values():
                event.synchronize()
            self._report(snap, end)

    def _report(self, snap: Snapshot, end: int) -> None:
        if end == len(snap.lazy):
            self._on_copied(snap)
        with self.cond:
            snap.copied_upto = end
            snap.ready = snap.lazy[end - 1][0] + 1
            self.cond.notify_all()
        self._on_progress(snap)


def guard_positions(lazy: Sequence[LazyCopy], owners: dict[int, set[int]]) -> dict[int, int]:
    """For each optimizer (``id`` -> storage pointers of its parameters and state), the
    last position in ``lazy`` whose source it would overwrite; optimizers that touch no
    lazy tensor are absent (their step never waits)."""
    out: dict[int, int] = {}
    for pos, (_, src, _) in enumerate(lazy):
        ptr = src.untyped_storage().data_ptr()
        for key, ptrs in owners.items():
            if ptr in ptrs:
                out[key] = pos
    return out


def wait_guard(cond: threading.Condition, snap: Snapshot, key: int) -> None:
    """The pre-step hook's wait for one snapshot: return once optimizer ``key`` may write
    its tensors (module docstring). Adds the time waited to ``snap.blocking_s``."""
    last = snap.guards.get(key)
    if last is None:
        return
    with cond:
        if snap.copied_upto > last or snap.aborted:
            return
        started = time.monotonic()
        if snap.waiting_since is None:
            snap.waiting_since = started
        while not (snap.copied_upto > last or snap.aborted or snap.queued.is_set()):
            cond.wait()
        if snap.waiting_since is not None:
            snap.blocking_s += time.monotonic() - snap.waiting_since
            snap.waiting_since = None
        final = snap.copied_upto > last or snap.aborted
    if not final:  # CUDA copies queued, not done: order the trainer's streams after them
        for dev, event in snap.copied.items():
            torch.cuda.current_stream(dev).wait_event(event)
