"""``isolate``: keep work off the culprit node, within the guard rails.

The rule may ask for hardware evidence or a repeat offence first
(``isolate_when: hardware_or_repeat``); the circuit breaker refuses when too many nodes are
isolated already. The actuator keeps work off the node; the isolation itself is recorded
through :class:`~controller.services.nodes.NodeRecords`, the one writer of node rows, in one
transaction with its action row (the policy's ``pending`` row finished, or an operator's
row inserted): there is never an isolation without its audit record, or the other way round.

An actuator error that says trying again may help (``ActuatorError.retryable``) is retried
by the policy's steps (:func:`call_actuator`: ``ACTUATOR_ATTEMPTS`` attempts, pausing
``ACTUATOR_BACKOFF_S`` between them); the action's outcome says how many attempts were
made and the last error. When the cluster-side isolation fails anyway, the policy's
isolate step still marks the node isolated in trainguard's own record (the reason says
the cluster-side isolation failed, and why), so no plan or grow-back puts work back on the
culprit; the action row says ``failed``, and the circuit breaker and the quarantine budget
count the node as they count any isolated one.

The circuit breaker and the quarantine budget count every node remediation isolated within
their windows, released since or not (read back from the ``isolate_node`` rows at each
isolation, so a restarted or new leader counts them too), plus the nodes isolated now (an
operator's by hand included while they stay isolated): a fleet whose nodes flap (isolated,
released, isolated again) cannot drain more than the share per window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Connection

from controller.actuators.base import ActuatorError, ActuatorResult
from controller.errors import ControllerError
from controller.logic.detection.c4d.job_evidence import (
    HangEvidence,
    LegacyStragglerEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.cause import POLICY_FACT, hardware_causes
from controller.logic.detection.incident_evidence import DegradedEvidence, QuarantineBudgetEvidence
from controller.logic.remediation import guards
from controller.logic.remediation.params import IsolateParams
from controller.logic.remediation.rules import IsolateWhen, Rule, Step
from controller.services.remediation.history import policy_isolations
from controller.services.remediation.partition import quarantine_refusal, raise_budget_incident
from controller.services.remediation.records import HARDWARE_KINDS, Remediation
from controller.services.remediation.steps import batch
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState

log = logging.getLogger(__name__)

#: How many times a policy step tries an actuator call whose error is ``retryable``.
ACTUATOR_ATTEMPTS = 3
#: The pause (s) before each retry of such a call: the 2nd attempt, the 3rd, ...
ACTUATOR_BACKOFF_S = (1.0, 2.0)

R = TypeVar("R")


class ActuatorGaveUp(ActuatorError):
    """An actuator call that failed for good: its message says how many attempts were
    made, whether the last error was retryable, and the last error itself."""

    def __init__(self, last: ActuatorError, attempts: int) -> None:
        if last.retryable:
            why = f"gave up after {attempts} attempts; last error (retryable)"
        elif attempts > 1:
            why = f"failed on attempt {attempts}; error not retryable"
        else:
            why = "failed on the first attempt; error not retryable"
        super().__init__(f"{why}: {last}", retryable=last.retryable)
        self.last = last
        self.attempts = attempts


async def call_actuator(call: Callable[[], Awaitable[R]]) -> tuple[R, int]:
    """``call()`` and how many attempts it took: an :class:`ActuatorError` that is
    ``retryable`` is tried again, up to ``ACTUATOR_ATTEMPTS`` times in all, after the
    pauses of ``ACTUATOR_BACKOFF_S``; the last error (or one that is not retryable)
    raises :class:`ActuatorGaveUp`. Only for idempotent calls (every actuator method is)."""
    attempt = 1
    while True:
        try:
            return await call(), attempt
        except ActuatorError as exc:
            if not exc.retryable or attempt >= ACTUATOR_ATTEMPTS:
                raise ActuatorGaveUp(exc, attempt) from exc
            pause = ACTUATOR_BACKOFF_S[min(attempt, len(ACTUATOR_BACKOFF_S)) - 1]
            log.warning(
                "actuator call failed (retryable), trying again in %.0f s: %s",
                pause,
                exc,
                extra={"fields": {"attempt": attempt}},
            )
            await asyncio.sleep(pause)
            attempt += 1


def attempts_note(attempts: int) -> str:
    """What an outcome adds when a call succeeded only after retries ("" at once)."""
    return f" (after {attempts} attempts)" if attempts > 1 else ""


#: What an isolation records with it: given (done, outcome), the write of its action row(s),
#: run in the isolation's own transaction (or alone when the actuator failed).
Audit = Callable[[bool, str], Callable[[Connection], Any]]


async def apply_isolation(
    ctx: StepContext,
    node: str,
    *,
    isolate: bool,
    reason: str,
    audit: Audit,
    retry: bool = False,
    keep_on_failure: bool = False,
) -> tuple[bool, str, Any]:
    """Isolate or release ``node`` through the actuator, then record it with its audit row
    in one transaction: the one path for the policy and for operators. Returns (done,
    outcome, what ``audit``'s write returned).

    ``retry``: a ``retryable`` actuator error is tried again (:func:`call_actuator`; the
    policy's step, not an operator's request, which answers at once).

    An actuator that fails changes nothing: only the (failed) audit row is written, unless
    ``keep_on_failure`` (the policy's isolation of a culprit): then the node is still
    recorded isolated, its reason saying the cluster-side isolation failed, with the failed
    audit row, so trainguard itself puts no work on it. A database that fails after the
    actuator acted raises (memory and database as before) and the actuator's change is
    undone, so the cluster does not keep a node cordoned that neither the API nor the
    database calls isolated (issue 14)."""
    outcome = f"{node} {'isolated' if isolate else 'released'}"
    actuator = ctx.actuator
    state = ctx.state.nodes.get(node)
    previous = state.isolated_reason if state is not None else None
    if actuator is not None:
        act = actuator.isolate_node if isolate else actuator.release_node

        async def call() -> ActuatorResult:
            return await act(node, reason=reason)

        try:
            if retry:
                result, attempts = await call_actuator(call)
                outcome = result.outcome + attempts_note(attempts)
            else:
                outcome = (await call()).outcome
        except ActuatorError as exc:
            failed = str(exc)[:2000]
            if isolate and keep_on_failure:
                failed = f"{failed}; {node} marked isolated in trainguard only"[:2000]
                kept = f"cluster-side isolation failed ({exc}); {reason}"[:500]
                return (
                    False,
                    failed,
                    await ctx.nodes.set_isolation(node, kept, audit=audit(False, failed)),
                )
            return False, failed, await ctx.store.write(audit(False, failed))
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


def _gpu_causes(incident: IncidentState) -> tuple[list[str], str]:
    """A straggler's or degraded GPU's hardware causes, and what of its slowdown
    trainguard's own power policy explains ("" when nothing)."""
    evidence = incident.evidence
    if not isinstance(
        evidence, StragglerIncidentEvidence | LegacyStragglerEvidence | DegradedEvidence
    ):
        return [], ""
    causes = hardware_causes(evidence.causes or [])
    gpu = getattr(evidence, "gpu", None)
    extra = gpu.model_extra if gpu is not None else None
    own = str((extra or {}).get(POLICY_FACT) or "")
    if not own and evidence.causes and len(causes) < len(evidence.causes):
        own = "its SM clock is locked by trainguard's power policy"  # a legacy record
    return causes, own


def own_cap_only(incident: IncidentState) -> str:
    """What trainguard's own power cap explains, when it is all the evidence names (a GPU
    obeying our cap is not degrading: nothing to isolate), else ""."""
    causes, own = _gpu_causes(incident)
    return "" if causes else own


def hardware_evidence(ctx: StepContext, incident: IncidentState, node: str) -> bool:
    if incident.kind in HARDWARE_KINDS:
        return True
    causes, _ = _gpu_causes(incident)
    if causes:
        return True  # the GPU is hot, throttled by hardware, or reports ECC errors
    state = ctx.state.nodes.get(node)
    return state is not None and (state.health != "healthy" or state.gpus_unhealthy > 0)


#: Per engine context, one lock per node: the "already isolated" check, the guards, the
#: actuator call and the stored isolation run as one, so two remediations that reach one
#: node together (two jobs on it) isolate it once and the second says "already isolated".
_NODE_LOCKS: weakref.WeakKeyDictionary[StepContext, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def node_lock(ctx: StepContext, node: str) -> asyncio.Lock:
    locks = _NODE_LOCKS.setdefault(ctx, {})
    lock = locks.get(node)
    if lock is None:
        lock = locks[node] = asyncio.Lock()
    return lock


#: Per engine context, one lock for the isolation budgets: each isolation's check and its
#: ``pending`` row (which the next check counts) run as one, taken inside a node's lock.
_BUDGET_LOCKS: weakref.WeakKeyDictionary[StepContext, asyncio.Lock] = weakref.WeakKeyDictionary()


def budget_lock(ctx: StepContext) -> asyncio.Lock:
    lock = _BUDGET_LOCKS.get(ctx)
    if lock is None:
        lock = _BUDGET_LOCKS[ctx] = asyncio.Lock()
    return lock


class Isolate:
    step = Step.ISOLATE
    action_kind = "isolate_node"

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        if incident is None or rule is None:
            return True, ""  # a grow-back has no culprit
        node = rem.node
        if node is None:
            outcome = "no single culprit node to isolate"
            await ctx.recorder.record(incident, rem, self.action_kind, "", {}, "skipped", outcome)
            return True, outcome
        # The job's other slow nodes known now: isolated too, so that it restarts once.
        also = batch.companions(ctx, rem, incident, time.time())
        ok, outcome = await self._one(ctx, rem, incident, rule, node)
        for other, incidents in also.items():
            first = incidents[0]
            own_rule = batch.rule_of(ctx, first) or rule
            ids = [i.id for i in incidents]
            done, said = await self._one(ctx, rem, first, own_rule, other, batched=ids)
            rem.batch.append(other)
            state = ctx.state.nodes.get(other)
            if not done and not rem.dry_run and (state is None or state.isolated_reason is None):
                batch.refused(ctx, incidents)
            outcome = f"{outcome}; {batch.note(other, first, said)}"
        return ok, outcome[:2000]

    async def _one(
        self,
        ctx: StepContext,
        rem: Remediation,
        incident: IncidentState,
        rule: Rule,
        node: str,
        *,
        batched: list[int] | None = None,
    ) -> StepResult:
        """Isolate ``node``, the culprit of ``incident``, as ``rule`` allows (``batched``: a
        companion's incidents, named by a budget's refusal: :func:`batch.refused`)."""
        record = ctx.recorder.record
        kind = self.action_kind
        now = time.time()
        if isinstance(incident.evidence, HangEvidence) and incident.evidence.deadlock:
            # Deterministic in the job's code: every run would deadlock again and, as a
            # "repeat", isolate one healthy node after another.
            outcome = (
                f"not isolating {node}: a deadlock (ranks waiting for each other in "
                "collectives issued in different orders) is the job's code, not the node"
            )
            await record(incident, rem, kind, node, {}, "skipped", outcome)
            return True, outcome
        book = ctx.book(rem.job) if rem.job else None
        history = book.culprits.setdefault(node, []) if book else []
        window = ctx.policy.guards.repeat_window_s
        repeat = any(now - t <= window for t in history)
        history.append(now)
        own = own_cap_only(incident)
        hardware = hardware_evidence(ctx, incident, node)
        if rule.isolate_when is IsolateWhen.HARDWARE_OR_REPEAT and own and not hardware:
            outcome = (
                f"not isolating {node}: its GPU is slowed by trainguard's own power cap "
                f"({own}), not a hardware fault"
            )[:2000]
            await record(incident, rem, kind, node, {}, "skipped", outcome)
            return True, outcome
        if rule.isolate_when is IsolateWhen.HARDWARE_OR_REPEAT and not (hardware or repeat):
            outcome = (
                f"not isolating {node}: no hardware evidence and its first offence "
                f"in {window:.0f} s"
            )
            await record(incident, rem, kind, node, {}, "skipped", outcome)
            return True, outcome
        async with node_lock(ctx, node):
            return await self._isolate(ctx, rem, incident, node, batched)

    async def _isolate(
        self,
        ctx: StepContext,
        rem: Remediation,
        incident: IncidentState,
        node: str,
        batched: list[int] | None,
    ) -> StepResult:
        """Under the node's lock: what another remediation stored meanwhile is seen."""
        record = ctx.recorder.record
        kind = self.action_kind
        node_state = ctx.state.nodes.get(node)
        if node_state is not None and node_state.isolated_reason is not None:
            outcome = f"{node} is already isolated"
            await record(incident, rem, kind, node, {}, "succeeded", outcome)
            return True, outcome
        reason = f"incident {incident.id} ({incident.kind}): {incident.summary}"[:500]
        # One budget check at a time, until its isolation's ``pending`` row is written:
        # two remediations isolating two nodes at once each see the other's.
        async with budget_lock(ctx):
            refused = await self._over_budget(ctx, rem, incident, node, batched)
            if refused is not None:
                return False, refused
            if rem.dry_run:
                rem.would_isolate.append(node)
                outcome = f"would isolate {node}"
                await record(incident, rem, kind, node, {}, "dry_run", outcome)
                return True, outcome
            params = IsolateParams(actuator=ctx.actuator.name if ctx.actuator else None)
            action = await record(incident, rem, kind, node, params.to_params(), "pending", "")

        def finish(ok: bool, outcome: str) -> Callable[[Connection], None]:
            return ctx.recorder.finishing(action, "succeeded" if ok else "failed", outcome)

        try:
            ok, outcome, _ = await apply_isolation(
                ctx,
                node,
                isolate=True,
                reason=reason,
                audit=finish,
                retry=True,
                keep_on_failure=True,
            )
        except ControllerError as exc:
            # Not stored (and undone at the actuator): the node is not isolated anywhere.
            outcome = f"isolation of {node} not recorded, undone: {exc.message}"[:2000]
            with contextlib.suppress(ControllerError):  # still down: a new leader closes it
                await ctx.recorder.finish(action, "failed", outcome)
            return False, outcome
        return ok, outcome

    async def _over_budget(
        self,
        ctx: StepContext,
        rem: Remediation,
        incident: IncidentState,
        node: str,
        batched: list[int] | None,
    ) -> str | None:
        """Why isolating ``node`` would overspend the circuit breaker or the quarantine
        budget (its ``skipped`` row written, and the budget incident raised), or ``None``.
        Both count the nodes isolated now and those remediation isolated within their
        windows, released since or not, read from the action rows each time (so a new
        leader counts its predecessor's isolations too).

        Either refusal leaves a faulty node in service, so either raises the one critical
        ``quarantine_budget`` incident for a human (``budget`` says which held): the
        breaker's used to be a ``skipped`` row only, unseen when it mattered most, in a
        mass failure."""
        record = ctx.recorder.record
        now = time.time()
        g = ctx.policy.guards
        since = now - max(g.isolation_window_s, ctx.partition.window_s)
        history = await ctx.store.read(lambda session: policy_isolations(session, since))
        isolated_since = {n.name: n.isolated_unix_s for n in ctx.state.nodes.values()}
        known = len(ctx.state.nodes)
        refused = guards.circuit_breaker(
            node,
            isolated_since=isolated_since,
            known_nodes=known,
            now_unix_s=now,
            guards=g,
            history=history,
        )
        said = batch.refusal_params(rem, batched)
        if refused is not None:
            await record(incident, rem, self.action_kind, node, said, "skipped", refused)
            if ctx.incidents is not None and not rem.dry_run:
                counted, _ = guards.isolated_in_window(
                    isolated_since, history, now_unix_s=now, window_s=g.isolation_window_s
                )
                evidence = QuarantineBudgetEvidence(
                    refused_node=node,
                    quarantined_in_window=len(counted - {node}),
                    limit=guards.breaker_limit(g, known),
                    fleet=max(known, 1),
                    window_s=g.isolation_window_s,
                    budget="circuit_breaker",
                )
                await raise_budget_incident(ctx.incidents, refused, evidence)
            return refused
        budget = quarantine_refusal(ctx.state, node, ctx.partition, now=now, history=history)
        if budget is not None and not rem.dry_run:
            message, evidence = budget
            await record(incident, rem, self.action_kind, node, said, "skipped", message)
            if ctx.incidents is not None:
                await raise_budget_incident(ctx.incidents, message, evidence)
            return message
        return None
