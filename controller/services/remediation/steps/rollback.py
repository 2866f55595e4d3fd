"""``rollback``: restart from the newest checkpoint committed *before* the damage began.

The incident's evidence names the first bad step (``evidence.step``: where NaN/Inf first
appeared). The committed steps come from the database (the agents' checkpoint events), not
from memory, so a leader that took over after the NaN still finds them.

Steps the job's retention reported ``deleted`` are not resumed from: when every checkpoint
committed before the bad step is gone, the rollback is refused (a ``skipped`` row saying
which steps were deleted and which is the oldest kept) and raises the critical
``restart_refused`` incident, instead of restarting the job into a resume that fails on
every rank (exit 3, and the job down). The steps before it (alert, evidence, isolation of a
node with hardware evidence) stand: they are right whatever the checkpoints are. The job is
left running, as when no checkpoint was ever committed before the bad step: stopping it or
restoring an older copy (a bucket, a backup) is a human's call.
"""

from __future__ import annotations

from controller.logic.detection.c4d.job_evidence import NonfiniteEvidence
from controller.logic.remediation.params import RestartParams, RollbackFacts
from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation import history
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.services.remediation.steps.restart import ACTION_KIND, refused_alert, restart
from controller.state import IncidentState


class Rollback:
    step = Step.ROLLBACK
    #: The same kind as a restart: the same restart budget and goodput ledger apply.
    action_kind = ACTION_KIND

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        job = rem.job
        if job is None:
            return True, "no job to roll back"
        evidence = incident.evidence if incident is not None else None
        bad = evidence.step if isinstance(evidence, NonfiniteEvidence) else None
        if bad is None:
            outcome = (
                "the incident names no step where the damage began: nothing to roll back "
                "to; restart the job by hand from a checkpoint you trust"
            )
            await ctx.recorder.record(incident, rem, ACTION_KIND, job, {}, "skipped", outcome)
            return False, outcome
        bound = await ctx.store.read(lambda session: history.rollback_bound(session, job, bad))
        clean = bound.clean
        rollback = RollbackFacts(bad_step=bad)
        params = RestartParams(rollback=rollback).to_params()
        if clean is None and bound.deleted:
            outcome = deleted_outcome(job, bad, bound)
            await ctx.recorder.record(incident, rem, ACTION_KIND, job, params, "skipped", outcome)
            await refused_alert(ctx, rem, incident, "checkpoint_deleted", outcome)
            return False, outcome
        if clean is None:
            outcome = (
                f"no checkpoint of job {job} was committed before step {bad}: nothing clean "
                "to roll back to; the job keeps running, decide by hand"
            )
            await ctx.recorder.record(incident, rem, ACTION_KIND, job, params, "skipped", outcome)
            return False, outcome
        return await restart(ctx, rem, incident, resume_step=clean, rollback=rollback)


def deleted_outcome(job: str, bad: int, bound: history.RollbackBound) -> str:
    """The refused rollback's outcome: what retention deleted, and why the oldest step kept
    is no way back either."""
    steps = ", ".join(map(str, bound.deleted))
    kept = bound.oldest_kept
    oldest = (
        f"the oldest kept is {kept}, which already carries the NaN/Inf"
        if kept is not None
        else "no committed checkpoint is kept at all"
    )
    return (
        f"not rolling back job {job}: no checkpoint before step {bad} is left: retention "
        f"deleted {steps}; {oldest}. The job keeps running as it is: restore a checkpoint "
        "you trust by hand (or raise the job's keep_last)"
    )[:2000]
