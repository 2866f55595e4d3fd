"""Faults for the simulated driver, injected while the agent runs.

A chaos drill on the simulated cluster (``trainguard demo``, the recovery benchmark) must
raise an XID or a thermal excursion at a moment chosen while the job runs, not at a time
fixed when the agent started. The agent follows a plain text file: each complete line
appended to it is one fault spec (``kind=xid,code=79,gpu=3,at=0``, ``at`` counted from the
moment the line is read). Nothing but the simulated backend reads it; a real GPU's
faults are real.
"""

from __future__ import annotations

import logging
from pathlib import Path

from agents.errors import AgentConfigError
from agents.gpu.faults import FaultSpec, parse_fault_spec
from trainguard.textfile import Unreadable, read_text

log = logging.getLogger(__name__)


class FaultFile:
    """Yields each new complete line of ``path`` once, parsed (bad lines are logged)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._problem = ""

    def check(self) -> None:
        """At start: a file that is not there yet is fine (followed until it appears); one
        that cannot be read as text (a directory, no permission, not UTF-8) is
        :class:`AgentConfigError`, a typo to fix rather than faults that never come."""
        try:
            read_text(self.path)
        except Unreadable as exc:
            if self.path.exists():  # not there yet (or a link to nothing yet): followed
                raise AgentConfigError(f"sim_fault_file {self.path}: {exc.reason}") from None

    def poll(self) -> list[FaultSpec]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
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
        faults = []
        for raw in data[: end + 1].decode("utf-8", "replace").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                faults.append(parse_fault_spec(line))
            except AgentConfigError as exc:
                log.warning("ignoring bad fault line in %s: %s", self.path, exc)
        return faults
