"""A job's own policy, and the human approval of a plan its ``dry_run`` holds back.

A Kubernetes workload may carry ``trainguard.io/policy`` (``Actuator.job_policy``): its
``steps`` replace the rule's steps for *that* job (the rule still decides whether and when
to act), and ``dry_run`` makes trainguard record what it would do, step by step as
``dry_run`` rows, then one ``approval`` row (status ``dry_run``, ``awaiting_approval``)
holding the plan. ``RemediationEngine.approve(action_id, actor)`` runs that plan for real,
once: the approval row is marked approved (by whom, when) before anything runs, so a second
approval, or one on another replica after a failover, is refused. A plan whose incident was
resolved meanwhile is refused too: approving acts on the incident as it is now, not on a
stale one.

A job policy that cannot be read (bad JSON, an unknown step) stops the remediation of that
job with a ``skip`` row naming the error: a job that asked for a dry run must not be acted
on because its annotation has a typo.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.actuators.base import ActuatorError
from controller.db.models import Action
from controller.logic.remediation.rules import Policy, Rule, Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext
from controller.state import ClusterState, IncidentState

#: The action kind of a plan awaiting approval.
APPROVAL_KIND = "approval"


class ApprovalError(ValueError):
    """An approval that cannot be carried out, in one line; ``status`` is the HTTP answer
    an API route gives it (404 unknown action, 409 not approvable now, 503 not leader)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


async def apply_job_policy(
    ctx: StepContext, rem: Remediation, incident: IncidentState | None, steps: list[Step]
) -> list[Step] | None:
    """The steps to run for ``rem`` under its job's own policy (``None``: do not act; a
    ``skip`` row says why). Sets ``rem.dry_run``/``awaiting_approval`` when the job asks for
    a dry run. An approved plan is not looked up again: its steps are the approved ones."""
    if rem.job is None or ctx.actuator is None or rem.approved_by is not None:
        return steps
    try:
        policy = await ctx.actuator.job_policy(rem.job)
        own = policy.step_list() if policy is not None else None
    except (ActuatorError, ValueError) as exc:
        outcome = f"job {rem.job}'s own policy: {exc}; not acting on it until that is fixed"
        await ctx.recorder.record(incident, rem, "skip", rem.job, {}, "skipped", outcome[:2000])
        rem.outcome = outcome
        return None
    if policy is None:
        return steps
    if own is not None and not rem.grow:
        steps = own
        rem.steps = [str(s) for s in steps]
    if policy.dry_run and not rem.dry_run:
        rem.dry_run = True
        # A grow-back has no incident to approve against: it is only recorded.
        rem.awaiting_approval = incident is not None
    return steps


async def record_plan(
    ctx: StepContext, rem: Remediation, incident: IncidentState, steps: list[Step]
) -> int:
    """The ``approval`` row: the plan the job's dry run held back, for a human to approve."""
    plan = ", ".join(str(s) for s in steps) or "nothing"
    outcome = (
        f"job {rem.job} asks for a dry run (trainguard.io/policy): planned {plan} for "
        f"incident {incident.id} ({incident.kind}); awaiting approval"
    )
    params = {"planned_steps": [str(s) for s in steps], "awaiting_approval": True}
    if rem.node is not None:
        params["node"] = rem.node
    if rem.batch:  # the job's other slow nodes: one plan isolates them all, one restart
        nodes = [n for n in [rem.node, *rem.batch] if n is not None]
        params["nodes"] = nodes
        outcome += f"; isolating {', '.join(nodes)}, then one restart"
    return await ctx.recorder.record(
        incident, rem, APPROVAL_KIND, rem.job or "", params, "dry_run", outcome
    )


def read_action(session: Session, action_id: int) -> dict[str, Any] | None:
    row = session.execute(select(Action).where(Action.id == action_id)).scalar_one_or_none()
    if row is None:
        return None
    return {"id": row.id, "kind": row.kind, "status": row.status, "params": dict(row.params)}


def check_approvable(
    row: dict[str, Any] | None,
    action_id: int,
    state: ClusterState,
    policy: Policy,
) -> tuple[IncidentState, Rule, list[Step], str]:
    """(incident, rule, steps, job) of an approvable plan, else :class:`ApprovalError`."""
    if row is None:
        raise ApprovalError(f"action {action_id} not found", 404)
    params = row["params"]
    if params.get("approved_by"):
        raise ApprovalError(f"action {action_id} was already approved by {params['approved_by']}")
    if row["kind"] != APPROVAL_KIND or not params.get("awaiting_approval"):
        raise ApprovalError(f"action {action_id} ({row['kind']}) is not a plan awaiting approval")
    if policy.dry_run or not policy.enabled:
        raise ApprovalError(
            "the controller's remediation policy is dry-run or disabled: nothing can run"
        )
    incident = state.incidents.get(params.get("incident", -1))
    if incident is None:
        raise ApprovalError(
            f"incident {params.get('incident')} of action {action_id} is no longer open; "
            "nothing to approve"
        )
    rule = policy.rule_for(incident.kind, incident.severity)
    if rule is None:
        raise ApprovalError(f"no rule acts on incident {incident.id} ({incident.kind}) any more")
    try:
        steps = [Step(s) for s in params.get("planned_steps") or []]
    except ValueError as exc:
        raise ApprovalError(f"action {action_id}: {exc}") from None
    job = params.get("job")
    if not isinstance(job, str) or not job:
        raise ApprovalError(f"action {action_id} names no job")
    return incident, rule, steps, job


def approved_params(params: dict[str, Any], actor: str) -> dict[str, Any]:
    return params | {
        "awaiting_approval": False,
        "approved_by": actor,
        "approved_unix_s": time.time(),
    }


__all__ = [
    "APPROVAL_KIND",
    "ApprovalError",
    "apply_job_policy",
    "approved_params",
    "check_approvable",
    "read_action",
    "record_plan",
]
