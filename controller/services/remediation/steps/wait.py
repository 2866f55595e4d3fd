"""The wait after a restart: the remediation is over once the job steps again.

A restart leaves its job *awaiting resume*. The first step of the new generation (rank 0's
step record, reported after the restart) ends the wait: the goodput ledger closes the
restart's window and the restart's action row gets ``resumed_unix_s`` and
``resumed_step``. No step within ``guards.resume_timeout_s`` fails the remediation, and the
restart's row says so (:func:`note_expired`): its status stays ``succeeded`` (the restart
took effect, and it still counts against the job's rate limit and goodput), its parameters
get ``resume_failed`` and its outcome ends with "did not resume within N s".
"""

from __future__ import annotations

import logging

from controller.logic.remediation.params import RestartParams
from controller.services.remediation import history
from controller.services.remediation.records import JobBook, Remediation
from controller.services.remediation.steps.base import StepContext

log = logging.getLogger(__name__)


async def step_seen(ctx: StepContext, book: JobBook, end_unix_s: float, step: int) -> None:
    """A step of ``book``'s job ended at ``end_unix_s``: does it end a restart's wait?"""
    waiting = book.awaiting_resume
    if waiting is None or waiting.restarted_unix_s is None:
        return
    if end_unix_s <= waiting.restarted_unix_s:
        return  # a step of the old generation, reported late
    _resumed(book, waiting, end_unix_s, step)
    await _note_resumed(ctx, waiting, end_unix_s, step)


def expire(ctx: StepContext, now_unix_s: float) -> list[Remediation]:
    """Fail the remediations whose job did not step within the resume timeout; returns them
    (their restart rows are written by :func:`note_expired`, off the caller's path)."""
    timeout_s = ctx.policy.guards.resume_timeout_s
    expired: list[Remediation] = []
    for book in ctx.jobs.values():
        waiting = book.awaiting_resume
        if (
            waiting is not None
            and waiting.restarted_unix_s is not None
            and now_unix_s - waiting.restarted_unix_s > timeout_s
        ):
            book.awaiting_resume = None
            waiting.state = "failed"
            waiting.outcome = (
                f"job {waiting.job} did not step within {timeout_s:.0f} s of its restart"
            )
            log.error("job did not resume", extra={"fields": {"remediation": waiting.id}})
            expired.append(waiting)
    return expired


def resume_failure(timeout_s: float) -> str:
    """What a restart's row says of a job that did not step again in time."""
    return f"did not resume within {timeout_s:.0f} s"


async def note_expired(ctx: StepContext, rem: Remediation, timeout_s: float) -> None:
    """Record on the restart's row that the job never stepped again (``resume_failed`` in
    its parameters, appended to its outcome), so the action log and a later leader see it."""
    if rem.restart_action is None or rem.restart_params is None:
        return
    failure = resume_failure(timeout_s)
    params = RestartParams.model_validate(
        rem.restart_params.to_params() | {"resume_failed": failure}
    )
    action = rem.restart_action
    try:
        outcome = await ctx.store.read(lambda s: history.outcome_of(s, action))
        outcome = f"{outcome}; {failure}" if outcome else f"restarted; {failure}"
        await ctx.recorder.update_params(action, params, outcome=outcome[:2000])
    except Exception:  # the log line above still tells; the engine must go on
        log.exception("could not record a failed resumption", extra={"fields": {"rem": rem.id}})


def _resumed(book: JobBook, rem: Remediation, at: float, step: int) -> None:
    book.awaiting_resume = None
    book.resumed_unix_s = at
    rem.resumed_unix_s = at
    book.ledger.resumed(at)
    lost = at - rem.started_unix_s
    log.info(
        "job resumed",
        extra={
            "fields": {
                "job": rem.job,
                "remediation": rem.id,
                "generation": rem.generation,
                "step": step,
                "since_remediation_s": round(lost, 2),
            }
        },
    )


async def _note_resumed(ctx: StepContext, rem: Remediation, at: float, step: int) -> None:
    """Add when the job resumed to its restart's row: the goodput a new leader rebuilds
    (:func:`~controller.services.remediation.history.replay`) needs it, and an operator sees
    the time to recover."""
    if rem.restart_action is None or rem.restart_params is None:
        return
    facts = rem.restart_params.goodput
    if facts is None:
        return
    resumed = facts.resumed(restart_unix_s=rem.restarted_unix_s, resumed_unix_s=at)
    params = RestartParams.model_validate(
        rem.restart_params.to_params() | {"goodput": resumed.to_params(), "resumed_step": step}
    )
    try:
        await ctx.recorder.update_params(rem.restart_action, params)
    except Exception:  # the record is a nicety; the ingest path must go on
        log.exception("could not record a resumption", extra={"fields": {"rem": rem.id}})
