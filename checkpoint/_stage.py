"""Pre-allocated host buffers that snapshots are copied into and reused across saves.

A buffer is a memory map: anonymous for the thread writer, a file in ``/dev/shm`` for the
writer process so that both processes see the same pages without a copy, and so that the
writer still holds the snapshot if the trainer is killed (persist-at-breakpoint). With
CUDA the pages are registered as pinned memory so device-to-host copies run asynchronously
at full PCIe bandwidth.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from pathlib import Path

import torch

ALIGN_BYTES = 64


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
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr(), self.size_bytes, 0
            )
            self.pinned = int(rc) == 0

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes].view(dtype).view(shape)

    def memory(self) -> memoryview:
        return memoryview(self._mm)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr()
            )
            self.pinned = False
        del self.tensor
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
