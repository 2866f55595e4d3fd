"""Job retention: finished jobs leave the controller's memory, their history stays stored.

A cluster runs thousands of jobs over months. Every job its ranks report gets a
:class:`~controller.state.JobState` and, in the services, detector windows, world-size
claims and a remediation book; none of them used to be dropped, so a long-lived controller
grew with every job it had ever seen. :class:`JobRetention` forgets a job once nothing has
been heard from it for ``job_retention_s`` (its ranks all exited, or went silent), through
:meth:`ClusterState.forget_job`, whose hooks let each service drop its own part. The
database keeps the job's rows (its ranks, checkpoints, incidents, actions); ``GET
/api/v1/jobs`` lists the jobs in memory, so a job leaves that list with the rest.

A job is kept, however quiet, while something still needs it: an open incident names it
(remediation finds the job's nodes through it), or a holder says so (the remediation
engine, while a remediation runs or a restart waits for the job's first step). A report
naming a forgotten job starts it afresh, as a new job of the same name.

The remediation engine sweeps on its tick (the leader's only), after a new leader has read
back the remediations in flight, so a failover cannot forget a job mid-restart either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from controller.state import ClusterState

log = logging.getLogger(__name__)


class JobRetention:
    """Forgets jobs not heard from for ``retention_s`` (see the module docstring)."""

    def __init__(
        self,
        state: ClusterState,
        retention_s: float,
        *,
        holds: Sequence[Callable[[str], bool]] = (),
    ) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention_s must be positive, got {retention_s}")
        self._state = state
        self.retention_s = retention_s
        #: Each returns True for a job it still needs (never forgotten while one does).
        self.holds = list(holds)
        #: Jobs forgotten since the controller started (for the log and the tests).
        self.forgotten_total = 0

    def sweep(self, now_unix_s: float) -> list[str]:
        """Forget every job quiet for ``retention_s`` that nothing holds; their names.

        Run on every tick of the remediation engine: one pass over the jobs in memory (a
        few microseconds each), so a job outlives its retention by at most a tick."""
        state = self._state
        quiet = [
            name
            for name, job in state.jobs.items()
            if now_unix_s - job.last_seen_unix_s >= self.retention_s
        ]
        if not quiet:
            return []
        with_incidents = {i.job for i in state.incidents.values() if i.job is not None}
        forgotten = []
        for name in quiet:
            if name in with_incidents or any(held(name) for held in self.holds):
                continue
            state.forget_job(name)
            forgotten.append(name)
        if forgotten:
            self.forgotten_total += len(forgotten)
            log.info(
                "forgot jobs not heard from within the retention period",
                extra={
                    "fields": {
                        "jobs": len(forgotten),
                        "first": forgotten[0],
                        "retention_s": self.retention_s,
                        "kept": len(state.jobs),
                    }
                },
            )
        return forgotten


__all__ = ["JobRetention"]
