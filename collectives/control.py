"""Controller commands relayed by the agent, turned into something a training loop can use.

Commands arrive on the shipping thread at any time; the training thread acts on them only
at step boundaries, where it is safe: a checkpoint request is answered by
:func:`should_checkpoint` (or the callbacks of :func:`on_checkpoint`, called after the step),
a stop request by :func:`should_stop`, and a link probe runs when the step named by
``at_step`` starts, so every rank runs it at the same point of the program.

Ranks agree on a step only through the command itself: the controller must pick
``at_step`` ahead of the job's progress. ``at_step`` is in the numbering the summaries
carry, which only goes forward within a process (``collectives.recorder.StepNumbering``):
the session hands :class:`Control` numbers in that numbering, so a request lands on the
same step on every rank even when the loop's own count starts again each epoch. A
request without ``at_step`` fires at the next step boundary each rank sees, which is fine
for one rank's own checkpoint but not for a collective one.

A checkpoint request reaches the nodes as one copy per node, some steps apart. A loop that
agrees across ranks (an all-reduce) would take one checkpoint per copy: a storm of full
checkpoints just before a restart, and with retention the checkpoint the controller
planned on can be pruned by them. :meth:`Control.checkpoint_vote` gives the newest request
*number* a rank holds; the loop takes the maximum over ranks and hands it back to
:meth:`Control.checkpoint_agreed`, after which copies of that request (and older ones)
are answered on every rank, also those still on their way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.wire import (
    Command,
    JobCheckpoint,
    JobCommand,
    JobDumpTrace,
    JobInjectFaults,
    JobLinkProbe,
    JobStop,
)

log = logging.getLogger("trainguard.collectives")

CheckpointCallback = Callable[[int], None]


@dataclass(slots=True)
class _CheckpointRequest:
    command_id: str
    at_step: int | None
    #: The request number shared by every node's copy (``None``: this copy alone).
    request: int | None


class Control:
    def __init__(self, job: str) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._checkpoints: list[_CheckpointRequest] = []
        #: Request numbers up to this one were answered by a checkpoint the job agreed on.
        self._answered = 0
        self._probes: dict[str, JobLinkProbe] = {}
        self._stop_reason: str | None = None
        self._faults: list[list[dict[str, Any]]] = []
        self.callbacks: list[CheckpointCallback] = []
        #: Answers a ``JobDumpTrace`` at once, on the shipping thread: it must work while the
        #: training thread is stuck in a collective, which is when it is asked for.
        self.on_dump_trace: Callable[[JobDumpTrace], None] | None = None

    def handle(self, commands: list[Command]) -> None:
        dumps: list[JobDumpTrace] = []
        with self._lock:
            for cmd in commands:
                if not isinstance(cmd, JobCommand):
                    continue
                if cmd.job != self.job or cmd.id in self._seen:
                    continue
                self._seen.add(cmd.id)
                if isinstance(cmd, JobCheckpoint):
                    if cmd.request is not None and cmd.request <= self._answered:
                        log.info(
                            "trainguard: checkpoint request %d (command %s) already answered",
                            cmd.request,
                            cmd.id,
                        )
                        continue
                    self._checkpoints.append(_CheckpointRequest(cmd.id, cmd.at_step, cmd.request))
                elif isinstance(cmd, JobStop):
                    self._stop_reason = cmd.reason or cmd.id
                elif isinstance(cmd, JobInjectFaults):
                    self._faults.append([f.model_dump() for f in cmd.faults])
                elif isinstance(cmd, JobDumpTrace):
                    dumps.append(cmd)
                else:
                    self._probes[cmd.id] = cmd
                log.info("trainguard: received %s command %s", cmd.kind, cmd.id)
        if self.on_dump_trace is not None:
            for dump in dumps:
                self.on_dump_trace(dump)

    # ------------------------------------------------------------------ training thread

    def checkpoint_due(self, step: int) -> bool:
        """True (once per request) when a checkpoint request applies after ``step``."""
        return self.checkpoint_vote(step) > 0

    def checkpoint_vote(self, step: int) -> int:
        """This rank's say in the job's agreement on a checkpoint after ``step``: 0 for
        none, else the newest request number due (1 for a request without one). Each
        request is voted for once."""
        with self._lock:
            due = [r for r in self._checkpoints if r.at_step is None or r.at_step <= step]
            if not due:
                return 0
            self._checkpoints = [r for r in self._checkpoints if r not in due]
            return max(r.request or 1 for r in due)

    def checkpoint_agreed(self, vote: int) -> None:
        """The job agreed on ``vote`` (the maximum over its ranks) and checkpoints for it:
        requests numbered up to it are answered, here and when their copies arrive."""
        with self._lock:
            self._answered = max(self._answered, vote)
            self._checkpoints = [
                r for r in self._checkpoints if r.request is None or r.request > self._answered
            ]

    def faults_due(self) -> list[list[dict[str, Any]]]:
        """Fault specs from chaos commands, to add on the training thread (once each)."""
        with self._lock:
            due, self._faults = self._faults, []
        return due

    def stop_requested(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def probes_due(self, step: int) -> tuple[list[JobLinkProbe], list[JobLinkProbe]]:
        """Probes to run at ``step``, and probes whose step has passed (too late to run)."""
        with self._lock:
            now = [p for p in self._probes.values() if p.at_step == step]
            late = [p for p in self._probes.values() if p.at_step < step]
            for p in now + late:
                del self._probes[p.id]
        return now, late


__all__ = ["CheckpointCallback", "Control"]
