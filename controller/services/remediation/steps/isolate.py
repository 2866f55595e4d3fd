"""``isolate``: keep work off the culprit node, within the guard rails.

The rule may ask for hardware evidence or a repeat offence first
(``isolate_when: hardware_or_repeat``); the circuit breaker refuses when too many nodes are
isolated already. The actuator keeps work off the node; the isolation itself is recorded
through :class:`~controller.services.nodes.NodeRecords`, the one writer of node rows, in one
transaction with its action row (the policy's ``pending`` row finished, or an operator's
row inserted): there is never an isolation without its audit record, or the other way round.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from controller.actuators.base import ActuatorError
from controller.errors import ControllerError
from controller.logic.detection.c4d.job_evidence import (
    LegacyStragglerEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.incident_evidence import DegradedEvidence
from controller.logic.remediation import guards
from controller.logic.remediation.params import IsolateParams
from controller.logic.remediation.rules import IsolateWhen, Rule, Step
from controller.services.remediation.partition import quarantine_refusal, raise_budget_incident
from controller.services.remediation.records import HARDWARE_KINDS, Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState

log = logging.getLogger(__name__)


#: What an isolation records with it: given (done, outcome), the write of its action row(s),
#: run in the isolation's own transaction (or alone when the actuator failed).
Audit = Callable[[bool, str], Callable[[Connection], Any]]


async def apply_isolation(
    ctx: StepContext, node: str, *, isolate: bool, reason: str, audit: Audit
) -> tuple[bool, str, Any]:
    """Isolate or release ``node`` through the actuator, then record it with its audit row
    in one transaction: the one path for the policy and for operators. Returns (done,
    outcome, what ``audit``'s write returned).

    An actuator that fails changes nothing: only the (failed) audit row is written. A
    database that fails after the actuator acted raises (memory and database as before)
    and the actuator's change is undone, so the cluster does not keep a node cordoned that
    neither the API nor the database calls isolated (issue 14)."""
    outcome = f"{node} {'isolated' if isolate else 'released'}"
    actuator = ctx.actuator
    state = ctx.state.nodes.get(node)
    previous = state.isolated_reason if state is not None else None
    if actuator is not None:
        call = actuator.isolate_node if isolate else actuator.release_node
        try:
            outcome = (await call(node, reason=reason)).outcome
        except ActuatorError as exc:
            return False, str(exc), await ctx.store.write(audit(False, str(exc)))
    try:
        written = await ctx.nodes.set_isolation(
            node, reason if isolate else None, audit=audit(True, outcome)
        )
    except Exception as exc:
        if actuator is not None:
            await _undo(ctx, node, isolate=isolate, previous=previous, error=exc)
        raise
    return True, outcome, written


async def _undo(
    ctx: StepContext, node: str, *, isolate: bool, previous: str | None, error: Exception
) -> None:
    """The compensation of an isolation (or release) the database did not take."""
    actuator = ctx.actuator
    if actuator is None:
        return
    why = f"not recorded ({type(error).__name__}), undone"
    try:
        if isolate:
            await actuator.release_node(node, reason=why)
        else:
            await actuator.isolate_node(node, reason=previous or why)
    except Exception:
        # Nothing left to do here: the operator sees the 503 and the log says what to check.
        log.exception(
            "could not undo an isolation change the database did not record",
            extra={"fields": {"node": node, "isolate": isolate}},
        )


def hardware_evidence(ctx: StepContext, incident: IncidentState, node: str) -> bool:
    if incident.kind in HARDWARE_KINDS:
        return True
    evidence = incident.evidence
    causes = (
        evidence.causes
        if isinstance(
            evidence, StragglerIncidentEvidence | LegacyStragglerEvidence | DegradedEvidence
        )
        else None
    )
    if causes:
        return True  # the GPU is throttled, hot, or reports ECC errors
    state = ctx.state.nodes.get(node)
    return state is not None and (state.health != "healthy" or state.gpus_unhealthy > 0)


class Isolate:
    step = Step.ISOLATE
    action_kind = "isolate_node"

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        if incident is None or rule is None:
            return True, ""  # a grow-back has no culprit
        record = ctx.recorder.record
        kind = self.action_kind
        node = rem.node
        now = time.time()
        if node is None:
            outcome = "no single culprit node to isolate"
            await record(incident, rem, kind, "", {}, "skipped", outcome)
            return True, outcome
        book = ctx.book(rem.job) if rem.job else None
        history = book.culprits.setdefault(node, []) if book else []
        window = ctx.policy.guards.repeat_window_s
        repeat = any(now - t <= window for t in history)
        history.append(now)
        if rule.isolate_when is IsolateWhen.HARDWARE_OR_REPEAT and not (
            hardware_evidence(ctx, incident, node) or repeat
        ):
            outcome = (
                f"not isolating {node}: no hardware evidence and its first offence "
                f"in {window:.0f} s"
            )
            await record(incident, rem, kind, node, {}, "skipped", outcome)
            return True, outcome
        node_state = ctx.state.nodes.get(node)
        if node_state is not None and node_state.isolated_reason is not None:
            outcome = f"{node} is already isolated"
            await record(incident, rem, kind, node, {}, "succeeded", outcome)
            return True, outcome
        refused = guards.circuit_breaker(
            node,
            isolated_since=[n.isolated_unix_s for n in ctx.state.nodes.values()],
            known_nodes=len(ctx.state.nodes),
            now_unix_s=now,
            guards=ctx.policy.guards,
        )
        if refused is not None:
            await record(incident, rem, kind, node, {}, "skipped", refused)
            return False, refused
        budget = quarantine_refusal(ctx.state, node, ctx.partition, now=now)
        if budget is not None and not rem.dry_run:
            message, evidence = budget
            await record(incident, rem, kind, node, {}, "skipped", message)
            if ctx.incidents is not None:
                await raise_budget_incident(ctx.incidents, message, evidence)
            return False, message
        reason = f"incident {incident.id} ({incident.kind}): {incident.summary}"[:500]
        if rem.dry_run:
            outcome = f"would isolate {node}"
            await record(incident, rem, kind, node, {}, "dry_run", outcome)
            return True, outcome
        params = IsolateParams(actuator=ctx.actuator.name if ctx.actuator else None).to_params()
        action = await record(incident, rem, kind, node, params, "pending", "")

        def finish(ok: bool, outcome: str) -> Callable[[Connection], None]:
            return ctx.recorder.finishing(action, "succeeded" if ok else "failed", outcome)

        try:
            ok, outcome, _ = await apply_isolation(
                ctx, node, isolate=True, reason=reason, audit=finish
            )
        except ControllerError as exc:
            # Not stored (and undone at the actuator): the node is not isolated anywhere.
            outcome = f"isolation of {node} not recorded, undone: {exc.message}"[:2000]
            with contextlib.suppress(ControllerError):  # still down: a new leader closes it
                await ctx.recorder.finish(action, "failed", outcome)
            return False, outcome
        return ok, outcome
