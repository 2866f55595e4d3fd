"""Stage 3 of a save, *write*: a rank's data file on disk, checksummed, durable.

Two writers produce the same file format. :class:`BufferFileWriter` (the engine's path)
writes straight from the host buffer as the copier fills it; :class:`DataFileWriter`
streams arbitrary buffers (the offline converter, callers whose buffer has gaps).
:func:`write_atomic` is the small-file variant the commit stage uses for manifests.

Why the buffer path is fast:

The engine lays tensors out in the host buffer exactly as they sit in the data file (same
offsets, zeroed alignment gaps), so persisting is "write bytes ``0..size`` of the buffer",
and three things decide the throughput on a machine with few cores:

* **No page-cache copy.** Bulk writes go through a second descriptor opened with
  ``O_DIRECT``: the device reads the (page-aligned) host buffer itself, so the writer spends
  almost no CPU per byte. A buffered ``write`` first copies every byte into the page cache,
  which on two shared cores costs as much CPU as the checksums. File systems or buffers that
  refuse ``O_DIRECT`` (tmpfs, an unaligned buffer) fall back to ordinary writes.
* **Checksums in parallel, beside the writes.** Each 4 MiB chunk has its own CRC, so
  chunks are hashed on ``hash_threads`` threads (:func:`checkpoint.crc.crc32` releases the
  GIL) while the same bytes are being written. Optional SHA-256 runs in order on one more
  thread.
* **Large writes.** ``os.pwrite`` of whole slices from a ``memoryview``: no ``bytes()``
  copy, no per-tensor syscalls.

* **Writes that do not extend the file.** When the size is known up front (the engine
  always knows it), the temp file is preallocated to it with ``fallocate`` first. Without
  that every ``O_DIRECT`` write appends, and ext4 serialises appending direct writes under
  the inode lock (and waits for each to finish before the next size update), so the
  ``IO_DEPTH`` writes "in flight" went to the device one at a time; into preallocated
  blocks they run side by side under a shared lock, and the file's blocks are allocated
  once, contiguously, instead of write by write.

One ``fsync`` at the end makes both descriptors' data durable (it flushes the inode, not a
descriptor); the temp name is then renamed to the final one, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from checkpoint.crc import crc32
from checkpoint.manifest import DataFileInfo

#: Alignment O_DIRECT needs for file offsets, lengths and memory addresses (a safe bound:
#: most devices need 512, some 4096).
DIRECT_ALIGN = 4096

#: Bytes per write call and per hashing task. Large enough to amortise Python per call,
#: small enough that writing starts soon after the copier reports progress.
SLICE_BYTES = 8 << 20

#: Concurrent writes (see ``BufferFileWriter._io_pool``). 4: with the file preallocated the
#: writes really overlap, and 4 beat 2 by ~10% on this machine's disk (write stage alone,
#: 2 GB, medians of 6, docs/checkpoint.md); appending, 4 was no better than 2 (serialised).
IO_DEPTH = 4


def _load_fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """Linux ``fallocate(2)`` through libc, or None. Not ``os.posix_fallocate``: where the
    file system lacks ``fallocate``, glibc emulates that one by writing a byte into every
    block, through the page cache (a million writes for 4 GB)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def preallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes for the file behind ``fd`` and set its size (mode 0), so
    later writes overwrite instead of extending it. False where the file system or the
    platform cannot (the writes then extend the file as before)."""
    if _FALLOCATE is None or size <= 0:
        return False
    return bool(_FALLOCATE(fd, 0, 0, size) == 0)


def name_file(exc: OSError, path: Path) -> None:
    """Give ``exc`` ``path`` as its file name when it has none. ``os.pwrite``, ``os.fsync``
    and a file object's ``write`` name no file, so a save that hit ENOSPC or EIO reached
    the caller as a bare ``[Errno 28] No space left on device`` (found by the damage sweep,
    ``tests/checkpoint/test_damage_sweep.py``); now it says which file."""
    if exc.filename is None and exc.errno is not None:
        exc.filename = str(path)


@contextlib.contextmanager
def aborted_on_error(writer: DataFileWriter | BufferFileWriter) -> Iterator[None]:
    """Abort ``writer``'s file on any error, and give an ``OSError`` the file's name
    (:func:`name_file`): what a data write that fails on ENOSPC or EIO says."""
    try:
        yield
    except BaseException as exc:
        writer.abort()
        if isinstance(exc, OSError):
            name_file(exc, writer.path)
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a rename is only durable once its dir is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        name_file(exc, path)
        raise
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    """A temporary name beside ``path`` that no other writer uses: the pid alone was not
    unique on a root shared across nodes (containers start their processes at the same
    small pids), so a zombie rank and its replacement on another node wrote the same temp
    file, one truncating the other's half-written copy."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        # A failed write (ENOSPC, EIO) left ``.MANIFEST.json.tmp-<pid>`` behind, on a disk
        # that is likely full; and the error named no file (:func:`name_file`).
        with contextlib.suppress(OSError):
            tmp.unlink()
        name_file(exc, path)
        raise
    fsync_dir(path.parent)


class DataFileWriter:
    """Streams one rank's data file, checksumming as it goes.

    CRC (and SHA-256) run on a helper thread while ``write`` copies the same bytes into the
    page cache: both release the GIL, and checksumming in line cost 30% of the write time
    (0.25 s per GB). The caller keeps each buffer unchanged until :meth:`finish`.
    """

    def __init__(self, path: Path, *, chunk_bytes: int, sha256: bool) -> None:
        self.path = path
        self._tmp = tmp_name(path)
        self._fh = open(self._tmp, "wb", buffering=0)  # noqa: SIM115 - closed in finish/abort
        self._sha = hashlib.sha256() if sha256 else None
        self._chunk_bytes = chunk_bytes
        self._crcs: list[int] = []
        self._crc = 0
        self._in_chunk = 0
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc")
        self._pending: list[Future[None]] = []
        self.size_bytes = 0

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self.size_bytes += len(view)
        self._pending.append(self._hasher.submit(self._account, view))
        while len(view):
            written = self._fh.write(view)
            if written is None or written <= 0:
                raise OSError(f"short write to {self._tmp}")
            view = view[written:]
        # Bound what the hasher still holds (the caller may drop each buffer once written,
        # as the streaming converter does) and surface hashing errors early.
        while len(self._pending) > 2:
            self._pending.pop(0).result()

    def _account(self, view: memoryview) -> None:
        if self._sha is not None:
            self._sha.update(view)
        while len(view):
            take = min(len(view), self._chunk_bytes - self._in_chunk)
            self._crc = crc32(view[:take], self._crc)
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self._chunk_bytes:
                self._crcs.append(self._crc)
                self._crc, self._in_chunk = 0, 0

    def pad_to(self, offset: int) -> None:
        if offset > self.size_bytes:
            self.write(bytes(offset - self.size_bytes))

    def finish(self) -> DataFileInfo:
        self._hasher.shutdown(wait=True)
        for fut in self._pending:
            fut.result()
        if self._in_chunk:
            self._crcs.append(self._crc)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)
        return DataFileInfo(
            name=self.path.name,
            size_bytes=self.size_bytes,
            sha256=self._sha.hexdigest() if self._sha is not None else "",
            chunk_bytes=self._chunk_bytes,
            chunk_crc32=self._crcs,
        )

    def abort(self) -> None:
        self._hasher.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._fh.close()
        with contextlib.suppress(OSError):
            self._tmp.unlink()


def _crc_chunks(view: memoryview, chunk_bytes: int) -> list[int]:
    return [crc32(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


class BufferFileWriter:
    """Writes ``buffer[0:size]`` to ``path`` as the caller reports a growing ready prefix.

    Call :meth:`advance` with the end of the prefix that is final in the buffer (it may be
    called many times, never with a smaller value), then :meth:`finish` with the file size.
    The buffer must stay unchanged until :meth:`finish` or :meth:`abort` returns.
    """

    def __init__(
        self,
        path: Path,
        buffer: memoryview,
        *,
        chunk_bytes: int,
        sha256: bool,
        hash_threads: int = 2,
        direct: bool = True,
        size_hint: int = 0,
    ) -> None:
        """``size_hint``: the file's final size if known (the engine's is), to preallocate
        it (module docstring); :meth:`finish` truncates to the size it is given."""
        self.path = path
        self._tmp = tmp_name(path)
        self._buf = buffer.cast("B") if buffer.format != "B" else buffer
        self._chunk = chunk_bytes
        self._slice = max(chunk_bytes, SLICE_BYTES // chunk_bytes * chunk_bytes)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self._tmp, flags, 0o644)
        self._dfd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(
                    self._tmp, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
                )
            except OSError:  # tmpfs and friends: buffered writes only
                self._dfd = -1
        self._direct = self._dfd >= 0
        #: Whether the file was preallocated to ``size_hint`` (see :func:`preallocate`).
        self.preallocated = self._direct and preallocate(self._fd, size_hint)
        self._lock = threading.Lock()
        #: Bytes written through O_DIRECT (the rest went through the page cache).
        self.direct_bytes = 0
        self._written = 0
        self._hashed = 0
        #: Writes in flight at once: while one thread waits for its write (or, in the
        #: trainer's process, for the GIL after it), the device works on the other's.
        self._io_pool = ThreadPoolExecutor(IO_DEPTH, thread_name_prefix="ckpt-io")
        self._io: list[Future[None]] = []
        self._crc_pool = ThreadPoolExecutor(max(1, hash_threads), thread_name_prefix="ckpt-crc")
        self._crcs: list[Future[list[int]]] = []
        self._sha = hashlib.sha256() if sha256 else None
        self._sha_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha") if sha256 else None
        self._sha_futs: list[Future[None]] = []

    # ------------------------------------------------------------------ hashing
    def _hash_upto(self, end: int, *, final: bool) -> None:
        """Queue CRCs of whole chunks below ``end`` (and the last partial one if final)."""
        start = self._hashed
        stop = end if final else start + (end - start) // self._chunk * self._chunk
        pos = start
        while pos < stop:
            nxt = min(stop, pos + self._slice)
            self._crcs.append(self._crc_pool.submit(_crc_chunks, self._buf[pos:nxt], self._chunk))
            if self._sha_pool is not None and self._sha is not None:
                self._sha_futs.append(self._sha_pool.submit(self._sha.update, self._buf[pos:nxt]))
            pos = nxt
        self._hashed = stop

    # ------------------------------------------------------------------ writing
    def _pwrite(self, fd: int, start: int, end: int) -> None:
        view = self._buf[start:end]
        pos = start
        while len(view):
            n = os.pwrite(fd, view, pos)
            if n <= 0:
                raise OSError(f"short write to {self._tmp}")
            view, pos = view[n:], pos + n

    def _write(self, start: int, end: int) -> None:
        """Write ``[start, end)``: O_DIRECT for the aligned part when possible. Runs on the
        I/O threads; pwrite at explicit offsets makes the order irrelevant."""
        if self._direct and start % DIRECT_ALIGN == 0:
            aligned_end = start + (end - start) // DIRECT_ALIGN * DIRECT_ALIGN
            if aligned_end > start:
                try:
                    self._pwrite(self._dfd, start, aligned_end)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct = False  # unaligned memory after all: buffered from now on
                else:
                    with self._lock:
                        self.direct_bytes += aligned_end - start
                    start = aligned_end
        if end > start:
            self._pwrite(self._fd, start, end)

    def advance(self, ready_end: int) -> None:
        """Bytes ``[0, ready_end)`` of the buffer are final: hash them, write whole slices."""
        self._hash_upto(ready_end, final=False)
        while ready_end - self._written >= self._slice:
            self._submit_write(self._written, self._written + self._slice)
            self._written += self._slice

    def _submit_write(self, start: int, end: int) -> None:
        while len(self._io) >= 2 * IO_DEPTH:  # bounded queue; surfaces errors early
            self._io.pop(0).result()
        self._io.append(self._io_pool.submit(self._write, start, end))

    def finish(self, size: int) -> DataFileInfo:
        """Write the rest up to ``size``, wait for the checksums, fsync, rename."""
        self._hash_upto(size, final=True)
        if size > self._written:
            self._submit_write(self._written, size)
            self._written = size
        for io_fut in self._io:
            io_fut.result()
        crcs = [crc for fut in self._crcs for crc in fut.result()]
        for sha_fut in self._sha_futs:
            sha_fut.result()
        self._shutdown_pools(cancel=False)
        if self.preallocated and os.fstat(self._fd).st_size != size:
            os.ftruncate(self._fd, size)  # a hint larger than what was written
        os.fsync(self._fd)
        self._close_fds()
        os.replace(self._tmp, self.path)
        return DataFileInfo(
            name=self.path.name,
            size_bytes=size,
            sha256=self._sha.hexdigest() if self._sha is not None else "",
            chunk_bytes=self._chunk,
            chunk_crc32=crcs,
        )

    def abort(self) -> None:
        self._shutdown_pools(cancel=True)
        self._close_fds()
        with contextlib.suppress(OSError):
            self._tmp.unlink()

    def _shutdown_pools(self, *, cancel: bool) -> None:
        self._io_pool.shutdown(wait=True, cancel_futures=cancel)
        self._crc_pool.shutdown(wait=True, cancel_futures=cancel)
        if self._sha_pool is not None:
            self._sha_pool.shutdown(wait=True, cancel_futures=cancel)

    def _close_fds(self) -> None:
        for fd in (self._dfd, self._fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._dfd = self._fd = -1


def gaps_are_zero(buffer: memoryview, spans: list[tuple[int, int]]) -> bool:
    """True when every byte of ``buffer`` between consecutive ``(offset, nbytes)`` spans
    (sorted, non-overlapping) is zero, so the buffer prefix *is* the data file."""
    pos = 0
    for offset, nbytes in spans:
        if offset < pos:
            return False
        if offset > pos and any(buffer[pos:offset]):
            return False
        pos = offset + nbytes
    return True
