"""``restart``: stop the job and start it again without excluded nodes, from a checkpoint.

The placement comes from :mod:`.shrink` (same size, shrunk or grown back); the restart
budget (``guards``) may refuse. A successful restart leaves the job *awaiting resume*
(:mod:`.wait`) until its first step of the new generation arrives.

A restart an incident asked for and that is refused (the rate limit, the actuator, no
placement) leaves the job as the fault left it: besides its ``restart_job`` row it opens
(or bumps) one critical ``restart_refused`` incident per job (:func:`refused_alert`), so
the refusal reaches a human like any fault; the job's next successful restart resolves it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from controller.actuators.base import ActuatorError, Placement
from controller.logic.detection.incident_evidence import RestartRefusedEvidence
from controller.logic.incident_kinds import IncidentKind
from controller.logic.remediation.params import GoodputFacts, RestartParams, RollbackFacts
from controller.logic.remediation.rules import Rule, Step
from controller.services.incidents import IncidentSpec
from controller.services.remediation.records import JobBook, Remediation, fault_time, running_on
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.services.remediation.steps.isolate import (
    attempts_note,
    call_actuator,
    own_cap_only,
)
from controller.services.remediation.steps.shrink import plan_placement
from controller.state import IncidentState

log = logging.getLogger(__name__)

ACTION_KIND = "restart_job"


async def restart(
    ctx: StepContext,
    rem: Remediation,
    incident: IncidentState | None,
    *,
    resume_step: int | None = None,
    rollback: RollbackFacts | None = None,
) -> StepResult:
    """Restart ``rem``'s job without excluded nodes. The ranks resume from the newest
    committed checkpoint; only a rollback bounds it (``resume_step``, with ``rollback``,
    its bad step, in the action's parameters).

    Without a rollback no bound goes to the job: it keeps training (and checkpointing)
    until its ranks are stopped, and with retention the checkpoint that was newest at this
    decision can be gone by then; a bound pinned to it left the new ranks nothing to
    resume from (exit 3, restarted again and again). The newest one at the decision is
    still what the action records and the goodput ledger prices.
    """
    record = ctx.recorder.record
    job = rem.job
    now = time.time()
    if job is None:
        return await _moved_off(ctx, rem, incident)
    own = own_cap_only(incident) if incident is not None and rollback is None else ""
    if own and not rem.grow:
        outcome = (
            f"not restarting job {job}: its straggler is slowed by trainguard's own power "
            f"cap ({own}); a restart would not lift it"
        )[:2000]
        await record(incident, rem, ACTION_KIND, job, {}, "skipped", outcome)
        return True, outcome
    refused = ctx.restarts.refuse(job, now, ctx.policy.guards)
    if refused is not None:
        await record(incident, rem, ACTION_KIND, job, {}, "skipped", refused)
        await refused_alert(ctx, rem, incident, "rate_limit", refused)
        return False, refused
    actuator = ctx.actuator
    if actuator is None:
        outcome = "no actuator configured: restart the job by hand"
        await record(incident, rem, ACTION_KIND, job, {}, "skipped", outcome)
        return False, outcome
    try:
        current = await actuator.current_placement(job)
    except ActuatorError as exc:  # e.g. new pods whose ranks have not reported yet
        outcome = f"cannot tell where job {job} runs: {exc}"
        await record(incident, rem, ACTION_KIND, job, {}, "failed", outcome[:2000])
        await refused_alert(ctx, rem, incident, "actuator", outcome)
        return False, outcome
    if current is None:
        outcome = f"job {job} is not managed by the {actuator.name} actuator"
        await record(incident, rem, ACTION_KIND, job, {}, "skipped", outcome)
        return False, outcome
    book = ctx.book(job)
    if incident is not None and rollback is None and not rem.grow:
        done = restarted_since(book, incident, current) or moved_off(book, incident, current)
        if done is not None:
            await record(incident, rem, ACTION_KIND, job, {}, "skipped", done)
            return True, done
    plan = await plan_placement(
        ctx,
        job,
        current,
        grow_back=rem.grow,
        resume_step=resume_step,
        also_excluded=rem.would_isolate if rem.dry_run else (),
    )
    placement = plan.placement
    if resume_step is None and book.checkpoint is not None:
        resume_step = book.checkpoint[0]  # expected: the newest committed one now
    given = RestartParams() if rollback is None else RestartParams(rollback=rollback)
    params: dict[str, Any] = given.to_params() | {
        "plan": plan.kind,
        "reason": plan.reason,
        "from_nodes": list(current.nodes),
        "from_world_size": current.world_size,
        "original_nodes": ctx.original_nodes[job],
        "resume_step": resume_step,
    }
    if placement is None:
        await record(incident, rem, ACTION_KIND, job, params, "failed", plan.reason)
        await refused_alert(ctx, rem, incident, "placement", plan.reason)
        return False, plan.reason
    if rem.grow and (plan.kind != "grow" or plan.replaced or plan.dropped):
        outcome = f"not grown: capacity is gone again ({plan.reason})"
        await record(incident, rem, ACTION_KIND, job, params, "skipped", outcome)
        return True, outcome
    params |= {
        "nodes": list(placement.nodes),
        "world_size": placement.world_size,
        "tp": placement.tp,
        "dp": placement.dp,
        "generation": placement.generation,
    }
    if placement.resume_step is not None:
        origin = f"step {placement.resume_step}"
    elif resume_step is not None:
        origin = f"the newest checkpoint (step {resume_step} now)"
    else:
        origin = "the newest checkpoint (none yet)"
    summary = (
        f"{plan.kind}: world {current.world_size} -> {placement.world_size} on "
        f"{', '.join(placement.nodes)}, from {origin}"
    )
    if rem.dry_run:
        await record(
            incident, rem, ACTION_KIND, job, params, "dry_run", "would restart: " + summary
        )
        return True, summary
    last_step = book.ledger.high_water_step
    params["goodput"] = GoodputFacts(
        ledger_id=rem.ledger_id,
        kind=incident.kind if incident is not None else "grow",
        fault_unix_s=fault_time(incident) if incident else rem.started_unix_s,
        detected_unix_s=incident.opened_unix_s if incident else rem.started_unix_s,
        last_step=last_step if last_step is not None else 0,
        resume_step=resume_step if resume_step is not None else 0,
        step_s=book.ledger.median_step_s(),
    ).to_params()
    action = await record(incident, rem, ACTION_KIND, job, params, "pending", "")
    try:
        # Retried when the error says so (a Kubernetes restart interrupted half-way): the
        # same placement and generation again, which every actuator converges on.
        result, attempts = await call_actuator(
            lambda: actuator.restart_job(placement, reason=f"remediation {rem.id}")
        )
    except ActuatorError as exc:
        await ctx.recorder.finish(action, "failed", str(exc)[:2000])
        await refused_alert(ctx, rem, incident, "actuator", str(exc))
        return False, str(exc)
    started = time.time()
    ctx.restarts.record(job, started)
    book.last_restart_unix_s = started
    book.ledger.restart_started(
        started,
        rem.ledger_id,
        last_step if last_step is not None else 0,
        resume_step if resume_step is not None else 0,
    )
    rem.generation = placement.generation
    rem.resume_step = resume_step
    rem.restarted_unix_s = started
    rem.restart_action = action
    rem.restart_params = RestartParams.model_validate(ctx.recorder.params(incident, rem, params))
    book.awaiting_resume = book.last_restart = rem
    await actuator.record_event(
        target=job, reason="TrainguardRestart", message=summary, warning=True
    )
    await ctx.recorder.finish(
        action, "succeeded", f"{summary}; {result.outcome}{attempts_note(attempts)}"
    )
    await _refusal_over(ctx, job, f"job {job} restarted by remediation {rem.id}: {summary}")
    return True, summary


def refused_key(job: str) -> str:
    """The dedupe key of ``job``'s ``restart_refused`` incident: one open per job."""
    return f"restart_refused:{job}"


async def refused_alert(
    ctx: StepContext, rem: Remediation, incident: IncidentState | None, why: str, detail: str
) -> None:
    """Open (or bump, with the newest refusal's summary and evidence) the critical
    ``restart_refused`` incident of ``rem``'s job: without it a refused restart was only a
    ``restart_job`` row, and the job stayed down or degraded with nothing alerting anyone.

    Only for a restart an incident asked for, that was meant to happen: a grow-back's
    refusal leaves a running job as it was, an operator's restart answers the operator
    itself, and a dry run does nothing anyway. ``why``: ``rate_limit``, ``actuator``,
    ``placement`` or (a rollback's) ``checkpoint_deleted``. An incident the database does
    not take is logged, never raised: the refusal is already recorded, and the step's
    outcome must stay the refusal's."""
    job = rem.job
    if incident is None or job is None or rem.grow or rem.dry_run or ctx.incidents is None:
        return
    evidence = RestartRefusedEvidence(
        job=job,
        why=why,
        detail=detail[:2000],
        for_incident=incident.id,
        for_incident_kind=incident.kind,
    )
    summary = (
        f"job {job} not restarted for incident {incident.id} ({incident.kind}), {why}: "
        f"{detail}; it stays as the fault left it until a human acts"
    )
    spec = IncidentSpec(
        kind=IncidentKind.RESTART_REFUSED,
        severity="critical",
        summary=summary[:500],
        dedupe_key=refused_key(job),
        job=job,
        evidence=evidence,
    )
    try:
        await ctx.incidents.open_or_bump(spec, refresh=True)
    except Exception:
        log.exception(
            "could not raise the restart_refused incident", extra={"fields": {"job": job}}
        )


async def _refusal_over(ctx: StepContext, job: str, note: str) -> None:
    """Resolve ``job``'s open ``restart_refused`` incident: the job was restarted after all."""
    open_now = ctx.incidents.find_open(refused_key(job)) if ctx.incidents is not None else None
    if ctx.incidents is None or open_now is None:
        return
    try:
        await ctx.incidents.resolve(open_now, note=note[:2000])
    except Exception:
        log.exception(
            "could not resolve the restart_refused incident", extra={"fields": {"job": job}}
        )


def restarted_since(book: JobBook, incident: IncidentState, current: Placement) -> str | None:
    """Why no restart is needed: the job already restarted after ``incident`` opened, on
    nodes without the incident's node (or, for an incident of the job itself, ending the
    run it was about). Two faults on one job within a second open two incidents; the
    first one's restart leaves out both nodes, and a second restart onto the same
    placement would only cost the job another stop and resume. A rollback is never
    skipped: the restart resumed from the newest checkpoint, which may hold the bad step.
    """
    if not book.restarted_since(incident.opened_unix_s):
        return None
    if incident.node is not None and incident.node in current.nodes:
        return None  # the restart kept the incident's node: there is still work to do
    without = f" without {incident.node}" if incident.node is not None else ""
    return (
        f"job {current.job} already restarted{without} after this incident opened "
        f"(generation {current.generation} on {', '.join(current.nodes)}): not restarted again"
    )


def moved_off(book: JobBook, incident: IncidentState, current: Placement | None) -> str | None:
    """Why no restart is needed: the job's newest restart already moved it off the
    incident's node (and the job is not back there). A node that flaps after a restart
    that never resumed opens incident after incident about a node the job left; restarting
    onto the same placement again would not help, only the resume failure needs a human."""
    node = incident.node
    left = book.left(node) if node is not None else None
    if node is None or left is None or (current is not None and node in current.nodes):
        return None
    params = left.restart_params
    if left.resumed_unix_s is not None:
        how = f"which resumed at step {params.resumed_step if params else None}"
    elif book.awaiting_resume is left:
        how = "which is waiting for the job to resume"
    else:
        how = "which has not resumed: see its resume_failed"
    return (
        f"job {left.job} already moved off {node} by restart {left.restart_action} "
        f"(generation {left.generation}), {how}: not restarted again"
    )


async def _moved_off(
    ctx: StepContext, rem: Remediation, incident: IncidentState | None
) -> StepResult:
    """A remediation for no job: name the jobs it is not about only because a restart moved
    them off the incident's node (each gets a ``skipped`` row saying so)."""
    notes: list[str] = []
    for name, book in sorted(ctx.jobs.items()):
        job = ctx.state.jobs.get(name)
        node = incident.node if incident is not None else None
        if incident is None or job is None or node is None:
            continue
        # Any running rank there, of whichever generation: the ones this looks for were
        # heard of before the restart that left the node (has_rank_on drops exactly those).
        note = moved_off(book, incident, None) if running_on(job, node) else None
        if note is not None:
            await ctx.recorder.record(incident, rem, ACTION_KIND, name, {}, "skipped", note)
            notes.append(note)
    return True, "; ".join(notes) or "no job to restart"


class Restart:
    step = Step.RESTART
    action_kind = ACTION_KIND

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        return await restart(ctx, rem, incident)
