"""``isolate``: keep work off the culprit node, within the guard rails.

The rule may ask for hardware evidence or a repeat offence first
(``isolate_when: hardware_or_repeat``); the circuit breaker refuses when too many nodes are
isolated already. The actuator keeps work off the node; the isolation itself is recorded
through :class:`~controller.services.nodes.NodeRecords`, the one writer of node rows.
"""

from __future__ import annotations

import time

from controller.actuators.base import ActuatorError
from controller.logic.remediation import guards
from controller.logic.remediation.params import IsolateParams
from controller.logic.remediation.rules import IsolateWhen, Rule, Step
from controller.services.remediation.partition import quarantine_refusal, raise_budget_incident
from controller.services.remediation.records import HARDWARE_KINDS, Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState


async def apply_isolation(ctx: StepContext, node: str, *, isolate: bool, reason: str) -> StepResult:
    """Isolate or release ``node`` through the actuator, then record it: the one path for
    the policy and for operators. Returns (done, outcome)."""
    outcome = f"{node} {'isolated' if isolate else 'released'}"
    actuator = ctx.actuator
    if actuator is not None:
        call = actuator.isolate_node if isolate else actuator.release_node
        try:
            outcome = (await call(node, reason=reason)).outcome
        except ActuatorError as exc:
            return False, str(exc)
    await ctx.nodes.set_isolation(node, reason if isolate else None)
    return True, outcome


def hardware_evidence(ctx: StepContext, incident: IncidentState, node: str) -> bool:
    if incident.kind in HARDWARE_KINDS:
        return True
    if incident.evidence.get("causes"):
        return True  # the straggler's GPU is throttled, hot, or reports ECC errors
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
        ok, outcome = await apply_isolation(ctx, node, isolate=True, reason=reason)
        await ctx.recorder.finish(action, "succeeded" if ok else "failed", outcome)
        return ok, outcome
