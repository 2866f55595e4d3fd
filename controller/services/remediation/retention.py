"""The remediation engine's part in job retention (:mod:`controller.services.job_retention`).

The engine keeps per job a book (goodput ledger, newest checkpoint, the remediation running
or the restart awaiting resume), the job's first size for grow-backs and the grow-back last
noted. It holds a job while a remediation of it is in flight, so a job is never forgotten
between its restart and its resume, and drops its part when the job is forgotten. A job of
the same name that reports later gets a fresh book: its goodput starts anew.
"""

from __future__ import annotations

from controller.services.job_retention import JobRetention
from controller.services.remediation.grow import GrowBack
from controller.services.remediation.steps.base import StepContext


def engine_retention(ctx: StepContext, grow: GrowBack, retention_s: float) -> JobRetention:
    """Job retention over ``ctx.state``, held by the engine's remediations in flight, with
    the engine's books dropped for each job it forgets."""

    def in_flight(job: str) -> bool:
        book = ctx.jobs.get(job)
        return book is not None and book.in_flight

    def forget(job: str) -> None:
        ctx.jobs.pop(job, None)
        ctx.original_nodes.pop(job, None)
        grow.forget(job)

    ctx.state.job_forgotten.append(forget)
    return JobRetention(ctx.state, retention_s, holds=[in_flight])


__all__ = ["engine_retention"]
