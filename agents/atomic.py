"""Crash-safe file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """tmp file in the same directory, fsync, rename over ``path``, fsync the directory.

    When writing, syncing or renaming the tmp file fails (ENOSPC, EIO), the tmp file is
    removed before the error is raised, so a failed write leaves no torn file behind to take
    up the space of a full disk."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


__all__ = ["fsync_dir", "write_atomic"]
