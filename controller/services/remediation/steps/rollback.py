"""``rollback``: restart from the newest checkpoint committed *before* the damage began.

The incident's evidence names the first bad step (``evidence.step``: where NaN/Inf first
appeared). The committed steps come from the database (the agents' checkpoint events), not
from memory, so a leader that took over after the NaN still finds them.
"""

from __future__ import annotations

from controller.logic.detection.c4d.job_evidence import NonfiniteEvidence
from controller.logic.remediation.params import RestartParams, RollbackFacts
from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation import history
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.services.remediation.steps.restart import ACTION_KIND, restart
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
        clean = await ctx.store.read(
            lambda session: history.newest_committed_before(session, job, bad)
        )
        rollback = RollbackFacts(bad_step=bad)
        params = RestartParams(rollback=rollback).to_params()
        if clean is None:
            outcome = (
                f"no checkpoint of job {job} was committed before step {bad}: nothing clean "
                "to roll back to; the job keeps running, decide by hand"
            )
            await ctx.recorder.record(incident, rem, ACTION_KIND, job, params, "skipped", outcome)
            return False, outcome
        return await restart(ctx, rem, incident, resume_step=clean, rollback=rollback)
