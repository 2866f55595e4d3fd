"""Faults for the simulated driver, injected while the agent runs.

A chaos drill on the simulated cluster (``trainguard demo``, the recovery benchmark) must
raise an XID or a thermal excursion at a moment chosen while the job runs, not at a time
fixed when the agent started. The agent follows a plain text file: each complete line
appended to it is one fault spec (``kind=xid,code=79,gpu=3,at=0``, ``at`` counted from the
moment the line is read). Nothing but the simulated backend reads it; a real GPU's
faults are real.

The file may also be rewritten instead of appended to (``echo spec > file``, an editor
saving a new file): when it is shorter than what was read, another file (inode) now, or no
longer holds the bytes last read just before the read offset, it is read again from the
start; so is a rewrite to the very same bytes, seen as a change of modification time with
no growth. A line naming a GPU the node does not have is refused on its own, with one
warning line; the other lines of the same poll still apply.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import BinaryIO

from agents.errors import AgentConfigError
from agents.gpu.faults import FaultSpec, parse_fault_spec
from trainguard.textfile import Unreadable, read_text

log = logging.getLogger(__name__)


#: Bytes kept from just before the read offset, to tell an append from a rewrite.
_TAIL = 256


class FaultFile:
    """Yields each new complete line of ``path`` once, parsed (bad lines are logged)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._problem = ""
        #: (inode, modification time) when the lines up to ``_offset`` were read.
        self._seen: tuple[int, int] | None = None
        #: The last bytes up to ``_offset`` (at most ``_TAIL``), as they were read.
        self._tail = b""

    def check(self) -> None:
        """At start: a file that is not there yet is fine (followed until it appears); one
        that cannot be read as text (a directory, no permission, not UTF-8) is
        :class:`AgentConfigError`, a typo to fix rather than faults that never come."""
        try:
            read_text(self.path)
        except Unreadable as exc:
            if self.path.exists():  # not there yet (or a link to nothing yet): followed
                raise AgentConfigError(f"sim_fault_file {self.path}: {exc.reason}") from None

    def poll(self, gpu_count: int | None = None) -> list[FaultSpec]:
        """New complete lines, parsed; with ``gpu_count``, a line for a GPU outside
        ``0 .. gpu_count - 1`` is refused (one warning line) and the rest still returned."""
        try:
            with self.path.open("rb") as f:
                data = self._read_new(f)
        except FileNotFoundError:
            return []
        except OSError as exc:  # replaced by a directory, permissions changed: say so once
            problem = exc.strerror or type(exc).__name__
            if problem != self._problem:
                log.warning("cannot read sim fault file %s: %s", self.path, problem)
            self._problem = problem
            return []
        self._problem = ""
        end = data.rfind(b"\n")
        if end < 0:
            return []  # a line still being written
        self._offset += end + 1
        self._tail = (self._tail + data[: end + 1])[-_TAIL:]
        faults = []
        for raw in data[: end + 1].decode("utf-8", "replace").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                fault = parse_fault_spec(line)
            except AgentConfigError as exc:
                log.warning("ignoring bad fault line in %s: %s", self.path, exc)
                continue
            if gpu_count is not None and not 0 <= fault.gpu < gpu_count:
                log.warning(
                    "ignoring fault line in %s: gpu %d out of range (the node has %d): %s",
                    self.path,
                    fault.gpu,
                    gpu_count,
                    line[:200],
                )
                continue
            faults.append(fault)
        return faults

    def _read_new(self, f: BinaryIO) -> bytes:
        """The bytes past the offset, from the start again when the file was rewritten."""
        f.seek(max(0, self._offset - len(self._tail)))
        data = f.read()
        st = os.fstat(f.fileno())  # after the read: a later write is seen next time
        seen, self._seen = self._seen, (st.st_ino, st.st_mtime_ns)
        tail_kept = data.startswith(self._tail) and len(data) >= len(self._tail)
        same_length_rewrite = (
            seen is not None and seen[1] != st.st_mtime_ns and len(data) == len(self._tail)
        )
        if self._offset and (
            (seen is not None and seen[0] != st.st_ino) or not tail_kept or same_length_rewrite
        ):
            log.info("sim fault file %s was rewritten; reading it from the start", self.path)
            self._offset, self._tail = 0, b""
            f.seek(0)
            return f.read()
        return data[len(self._tail) :]
