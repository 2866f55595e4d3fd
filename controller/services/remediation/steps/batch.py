"""Slow nodes of one job found together: one remediation isolates them all, one restart.

A straggler is judged per rank, and two slow nodes of one job open their incidents within
seconds. Remediated one node at a time, the first restart kept the other node (it was not
isolated yet), and that node's incident then stopped and restarted the job a second time:
minutes of every GPU of the job, for a node known at the first decision. So the ``isolate``
step of a remediation that goes on to ``restart`` also isolates the other nodes named by
the job's open, undecided, non-hardware incidents whose own rule would isolate and restart
them now (:func:`companions`): the ones open at the decision and those that arrived before
the step ran (during the protective checkpoint). The restart then leaves every isolated
node out, and the companions are absorbed as covered once the job has resumed
(:meth:`~.records.JobBook.covered`), as a slow node's other ranks are.

Hardware faults are not batched: their node is unhealthy, so the first restart leaves it
out anyway (the restart step's ``restarted_since``). Each companion's isolation passes the
same guard rails as the culprit's (its rule's ``isolate_when``, the circuit breaker, the
quarantine budget); a companion the budget refuses stays in the job, and its incidents are
decided as ``batched, isolation refused`` (:func:`refused`): they stay open for a human
(the budget's own incident says why), and are not acted on again, which would only restart
the job onto the same nodes, once per incident, until the rate limit. The refusal's
``isolate_node`` row (under the first incident's trigger) names them in its
``refused_incidents`` parameter (:func:`refusal_params`), so a new leader, after a failover
or a restart, decides them too
(:func:`~controller.services.remediation.history.refused_companions`) instead of acting on
each again. An isolated companion's incidents need no such mark: whichever leader sees the
job resume absorbs them as covered (the restart's row says where the job went).
"""

from __future__ import annotations

from controller.logic.detection.c4d.job_evidence import NonfiniteEvidence
from controller.logic.remediation import guards
from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation.history import REFUSED_INCIDENTS
from controller.services.remediation.records import (
    HARDWARE_KINDS,
    Remediation,
    culprit_node,
    straggler_cost,
)
from controller.services.remediation.steps.base import StepContext
from controller.state import IncidentState

#: What the engine's ``decided`` says of a companion whose isolation the budget refused.
REFUSED = "batched, isolation refused"


def ready(incident: IncidentState, rule: Rule, now: float) -> bool:
    """Whether ``rule``'s conditions hold for ``incident`` now: open ``after_s``, costing
    ``min_cost_pct`` of the job's throughput, lasting ``min_bad_steps`` steps. The engine
    waits for them before acting, and a companion must meet them too: a straggler too
    cheap to act on alone is not isolated because another node was."""
    if now - incident.opened_unix_s < rule.after_s:
        return False  # not persisted long enough yet
    if rule.min_cost_pct > 0:
        cost = straggler_cost(incident)
        if cost is None or cost < rule.min_cost_pct:
            return False  # cheap so far; it may grow while the incident stays open
    if rule.min_bad_steps > 0:
        evidence = incident.evidence
        bad = evidence.bad_steps if isinstance(evidence, NonfiniteEvidence) else None
        if bad is None or bad < rule.min_bad_steps:
            return False  # possibly a skipped overflow; a diverged job adds one per step
    return True


def companions(
    ctx: StepContext, rem: Remediation, incident: IncidentState, now: float
) -> dict[str, list[IncidentState]]:
    """Other nodes of ``rem``'s job to isolate with its culprit: node -> its incidents
    (oldest first). Empty unless ``rem`` restarts (not a rollback, which is never covered)
    and is about a job's own non-hardware incident with one culprit node."""
    job = rem.job
    if (
        job is None
        or rem.node is None
        or incident.job != job
        or incident.kind in HARDWARE_KINDS
        or str(Step.RESTART) not in rem.steps
        or str(Step.ROLLBACK) in rem.steps
    ):
        return {}
    book = ctx.book(job)
    found: dict[str, list[IncidentState]] = {}
    for other in sorted(ctx.state.incidents.values(), key=lambda i: i.id):
        node = culprit_node(other)
        if (
            other.id == incident.id
            or other.id in ctx.decided
            or other.job != job
            or other.kind in HARDWARE_KINDS
            or node is None
            or node == rem.node
            or book.covered(other) is not None
        ):
            continue
        if _would_act(ctx, other, now):
            found.setdefault(node, []).append(other)
    return found


def _would_act(ctx: StepContext, incident: IncidentState, now: float) -> bool:
    """Whether ``incident``'s own rule would isolate its node and restart the job now."""
    policy = ctx.policy
    rule = policy.rule_for(incident.kind, incident.severity)
    if rule is None or Step.ROLLBACK in rule.steps:
        return False
    if Step.ISOLATE not in rule.steps or Step.RESTART not in rule.steps:
        return False
    if guards.stale(incident.updated_unix_s, now, policy.guards) is not None:
        return False
    return ready(incident, rule, now)


def rule_of(ctx: StepContext, incident: IncidentState) -> Rule | None:
    """The rule in force for ``incident`` (its ``isolate_when`` guards its isolation)."""
    return ctx.policy.rule_for(incident.kind, incident.severity)


def refusal_params(rem: Remediation, batched: list[int] | None) -> dict[str, list[int]]:
    """The parameters of a budget's refusal to isolate a companion node whose incidents are
    ``batched``: their ids, which :func:`refused` decides, for a new leader to read back
    (nothing for the culprit's own refusal, or a dry run's, which decides nothing)."""
    if not batched or rem.dry_run:
        return {}
    return {REFUSED_INCIDENTS: list(batched)}


def refused(ctx: StepContext, incidents: list[IncidentState]) -> None:
    """Decide a companion node's incidents whose isolation the budget refused: the restart
    keeps that node, and acting on them again would only restart onto the same nodes."""
    for incident in incidents:
        ctx.decided[incident.id] = REFUSED


def note(node: str, first: IncidentState, outcome: str) -> str:
    """A companion's part of the isolate step's outcome."""
    return f"{outcome} (also slow: incident {first.id}, {first.kind} on {node}; one restart)"
