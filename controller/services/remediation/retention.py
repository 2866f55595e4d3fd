"""The remediation engine's part in job retention (:mod:`controller.services.job_retention`).

The engine keeps per job a book (goodput ledger, newest checkpoint, the remediation running
or the restart awaiting resume), the job's first size for grow-backs and the grow-back last
noted. It holds a job while a remediation of it is in flight, so a job is never forgotten
between its restart and its resume, and drops its part when the job is forgotten. A job of
the same name that reports later gets a fresh book: its goodput starts anew.

The actuator's own per-job memory (the Kubernetes actuator's placements learned from the
ranks, its workloads' limits) goes with it when the actuator offers a way to drop it
(:class:`~controller.actuators.base.ForgetsJobs`). The restart budget is not dropped with
the job (the rate limit outlives a quiet spell): each sweep expires the jobs whose restarts
all left the policy's window, whether the job is still in memory or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.actuators.base import ForgetsJobs
from controller.services.job_retention import JobRetention
from controller.services.remediation.grow import GrowBack
from controller.services.remediation.steps.base import StepContext


class EngineRetention(JobRetention):
    """:class:`JobRetention` whose sweep also expires the engine's restart budget."""

    def __init__(
        self, ctx: StepContext, retention_s: float, holds: Sequence[Callable[[str], bool]]
    ) -> None:
        super().__init__(ctx.state, retention_s, holds=holds)
        self._ctx = ctx

    def sweep(self, now_unix_s: float) -> list[str]:
        self._ctx.restarts.expire(now_unix_s, self._ctx.policy.guards.restart_window_s)
        return super().sweep(now_unix_s)


def engine_retention(ctx: StepContext, grow: GrowBack, retention_s: float) -> JobRetention:
    """Job retention over ``ctx.state``, held by the engine's remediations in flight, with
    the engine's books, and the actuator's memory of the job, dropped for each job it
    forgets."""

    def in_flight(job: str) -> bool:
        book = ctx.jobs.get(job)
        return book is not None and book.in_flight

    def forget(job: str) -> None:
        ctx.jobs.pop(job, None)
        ctx.original_nodes.pop(job, None)
        grow.forget(job)
        actuator = ctx.actuator  # read now: it may have been replaced since
        if isinstance(actuator, ForgetsJobs):
            actuator.forget_job(job)

    ctx.state.job_forgotten.append(forget)
    return EngineRetention(ctx, retention_s, holds=[in_flight])


__all__ = ["EngineRetention", "engine_retention"]
