"""Operator actions that drive the remediation engine by hand: restart a job, and approve an
action that was only recorded (``dry_run``).

Two kinds of dry run can be approved through ``POST /api/v1/actions/{id}/approve``:

* an ``approval`` row, the plan a *job's own* policy held back (``trainguard.io/policy``
  with ``dry_run``): :meth:`RemediationEngine.approve` runs that plan once (its rules:
  :mod:`controller.services.remediation.approval`);
* a step the *controller's* policy recorded in dry-run mode (``policy.dry_run``): a
  ``restart_job`` or ``isolate_node`` row is carried out here, through the same code as the
  policy's own steps (the ``restart`` step and ``apply_isolation``, which act only through
  the actuator interface). Such an approval is itself an action row (``approve_action``,
  target ``action:<id>``): a dry run is approved at most once, and the row names what was
  carried out.

Everything done by hand leaves action rows triggered ``operator:<name>``, so the audit
trail reads like the policy's.

This module sits beside :mod:`controller.services.actions` rather than in it: the engine
imports that module, and the acyclic-siblings contract forbids the way back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from controller.db.models import Action
from controller.errors import Conflict, ControllerError, NotFound, TemporaryError
from controller.services.actions import ActionService
from controller.services.remediation.approval import APPROVAL_KIND, ApprovalError
from controller.services.remediation.engine import RECENT_REMEDIATIONS, RemediationEngine
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.restart import ACTION_KIND as RESTART_KIND
from controller.services.remediation.steps.restart import restart
from controller.store import Store

#: Dry-run kinds an operator may approve (what carrying each out means is below).
APPROVABLE = frozenset({RESTART_KIND, "isolate_node"})
APPROVE_KIND = "approve_action"

log = logging.getLogger(__name__)


def isolation_audit(
    actions: ActionService,
    engine: RemediationEngine,
    node: str,
    actor: str,
    reason: str,
    *,
    isolate: bool = True,
) -> Callable[[bool, str], Callable[[Connection], int]]:
    """The ``isolate_node`` (``release_node``) row of an isolation (release) by hand, for
    ``apply_isolation``'s ``audit``: built once the result is known, as a step of the
    isolation's own transaction (no isolation without its record), dated when asked."""
    started = time.time()

    def audit(ok: bool, outcome: str) -> Callable[[Connection], int]:
        actuator = engine.actuator
        return actions.inserting(
            kind="isolate_node" if isolate else "release_node",
            target=node,
            trigger=f"operator:{actor}",
            params={"reason": reason, "actuator": actuator.name if actuator else None},
            status="succeeded" if ok else "failed",
            outcome=outcome,
            created_unix_s=started,
        )

    return audit


async def restart_job(
    engine: RemediationEngine, actions: ActionService, job: str, actor: str, reason: str
) -> dict[str, Any]:
    """Restart ``job`` now through the actuator, from its newest committed checkpoint,
    without isolated nodes: the policy's ``restart`` step, triggered ``operator:<actor>``.

    Synchronous (the reply says what happened), and under the same guard rails as the
    policy's restarts: refused while another remediation of the job runs or waits for the
    job to resume, and by the restart rate limit. An operator's restart is never a dry
    run: the operator is the approval. ``reason`` leads the restart row's outcome."""
    if not engine.is_leader():
        raise TemporaryError("this replica is not the leader: restart the job on the leader")
    if engine.actuator is None:
        raise Conflict(
            "no actuator configured (settings: actuator): trainguard cannot restart jobs here;"
            " restart it by hand"
        )
    book = engine.book(job)
    busy = book.running or book.awaiting_resume
    if busy is not None:
        raise Conflict(f"job {job!r} has a remediation in progress ({busy.id}); wait for it")
    now = time.time()
    rem = Remediation(
        id=uuid.uuid4().hex[:12],
        incident_id=None,
        incident_kind="operator",
        job=job,
        node=None,
        steps=["restart"],
        started_unix_s=now,
        dry_run=False,
        trigger=f"operator:{actor}"[:128],
        outcome=reason,
    )
    # Bookkeeping as the engine's own remediations do it (engine._start / _run): the job is
    # busy while it restarts, the restart's cost goes into its goodput ledger, and the
    # remediation is listed by GET /remediation.
    engine.remediations.append(rem)
    del engine.remediations[:-RECENT_REMEDIATIONS]
    book.running = rem
    book.last_remediation_unix_s = now
    book.ledger.fault(now, rem.ledger_id, "operator")
    book.ledger.detected(now, rem.ledger_id)
    ok, outcome = False, ""
    try:
        ok, outcome = await restart(engine.ctx, rem, None)
    finally:
        rem.finished_unix_s = time.time()
        rem.state = "done" if ok else "failed"
        rem.outcome = outcome
        book.running = None
        if rem.restarted_unix_s is None:
            book.ledger.closed(rem.finished_unix_s, rem.ledger_id)
    action_id = rem.restart_action
    if action_id is not None:  # the step wrote its row; say who asked, and why, first

        def recorded(session: Session) -> str:
            row = session.get(Action, action_id)
            return row.outcome if row is not None else ""

        done = await engine.ctx.store.read(recorded)
        await actions.update(action_id, outcome=f"by hand: {reason}; {done}"[:2000])
    if not ok:
        raise Conflict(f"restart of job {job!r} not done: {outcome}")
    return {
        "job": job,
        "remediation": rem.id,
        "action": rem.restart_action,
        "generation": rem.generation,
        "resume_step": rem.resume_step,
        "outcome": outcome,
    }


class Approvals:
    """Approves dry-run actions, each at most once (also across concurrent requests)."""

    def __init__(self, store: Store, actions: ActionService, engine: RemediationEngine) -> None:
        self._store = store
        self._actions = actions
        self._engine = engine
        self._lock = asyncio.Lock()

    async def approve(self, action_id: int, actor: str) -> dict[str, Any]:
        """Carry out what dry-run action ``action_id`` would have done, now: an
        ``approval`` plan runs through the engine; ``restart_job`` restarts its job
        (:func:`restart_job`), ``isolate_node`` isolates its node. 404 for no such action,
        409 for one that is not a dry run, not of an approvable kind, approved already, or
        whose effect fails."""

        def read(session: Session) -> tuple[Action | None, bool, int | None]:
            row = session.get(Action, action_id)
            if row is None:
                return None, False, None
            session.expunge(row)
            # A step of a job policy's held-back plan is approved with its plan, as a whole.
            plan = None
            rem = row.params.get("remediation")
            if row.kind != APPROVAL_KIND and rem:
                plans = session.execute(
                    select(Action.id, Action.params).where(
                        Action.kind == APPROVAL_KIND, Action.trigger == row.trigger
                    )
                ).all()
                plan = next((i for i, params in plans if params.get("remediation") == rem), None)
            approved = session.execute(
                select(Action.id).where(
                    Action.kind == APPROVE_KIND,
                    Action.target == f"action:{action_id}",
                    # A pending approval claimed the dry run; its end may not be stored.
                    Action.status.in_(("succeeded", "pending")),
                )
            ).first()
            return row, approved is not None, plan

        async with self._lock:
            row, approved, plan = await self._store.read(read)
            if row is None:
                raise NotFound(f"action {action_id} not found")
            if row.kind == APPROVAL_KIND:
                return await self._approve_plan(action_id, actor)
            if plan is not None:
                raise Conflict(
                    f"action {action_id} is a step of the plan in action {plan}, which the"
                    f" job's own policy holds for approval: approve action {plan}"
                )
            if row.status != "dry_run":
                raise Conflict(f"action {action_id} is {row.status}, not a dry run")
            if approved:
                raise Conflict(f"action {action_id} is approved already")
            if row.kind not in APPROVABLE:
                raise Conflict(
                    f"a dry-run {row.kind} cannot be approved here (only "
                    f"{', '.join(sorted(APPROVABLE))}); do it by hand"
                )
            reason = f"approved dry run #{action_id} by {actor}"
            if row.kind == RESTART_KIND:
                job = str(row.params.get("job") or row.target)
                carried, outcome, approval = await self._restart(action_id, job, actor, reason)
            else:
                carried, outcome, approval = await self._isolate(
                    action_id, row.target, actor, reason
                )
            return {
                "action": action_id,
                "kind": row.kind,
                "approval": approval,
                "carried_out": carried,
                "outcome": outcome,
            }

    async def _approve_plan(self, action_id: int, actor: str) -> dict[str, Any]:
        """A job policy's held-back plan: the engine runs it (and keeps it to once)."""
        try:
            started = await self._engine.approve(action_id, actor)
        except ApprovalError as exc:
            error = {404: NotFound, 503: TemporaryError}.get(exc.status, Conflict)
            raise error(str(exc)) from None
        return {
            "action": action_id,
            "kind": APPROVAL_KIND,
            "approval": action_id,
            "carried_out": None,
            "remediation": started,
            "outcome": f"approved by {actor}: running {', '.join(started.get('steps', []))}",
        }

    async def _restart(
        self, action_id: int, job: str, actor: str, reason: str
    ) -> tuple[int | None, str, int]:
        """Restart ``job`` for dry run ``action_id``. A restart cannot share a transaction
        with its record (the actuator acts in between), so the approval row claims the dry
        run first (``pending``): a database that fails then refuses the approval before
        anything happens, and a row whose end could not be stored keeps the dry run from
        being approved, and the job restarted, twice."""
        approval = await self._record(action_id, RESTART_KIND, actor, None, "pending", reason)
        try:
            done = await restart_job(self._engine, self._actions, job, actor, reason)
        except Exception as exc:
            message = exc.message if isinstance(exc, ControllerError) else f"{type(exc).__name__}"
            await self._end(action_id, approval, None, "failed", message)
            raise
        carried, outcome = done["action"], done["outcome"]
        await self._end(action_id, approval, carried, "succeeded", f"{reason}: {outcome}")
        return carried, outcome, approval

    async def _end(
        self, action_id: int, approval: int, carried: int | None, status: str, outcome: str
    ) -> None:
        """Finish a restart's approval row; not stored, it stays ``pending`` (logged)."""
        try:
            await self._actions.update(
                approval,
                params={"action": action_id, "kind": RESTART_KIND, "carried_out": carried},
                status=status,
                outcome=outcome[:2000],
                finished_unix_s=time.time(),
            )
        except ControllerError as exc:
            log.warning(
                "approval row left pending",
                extra={"fields": {"approval": approval, "error": exc.message}},
            )

    async def _isolate(
        self, action_id: int, node: str, actor: str, reason: str
    ) -> tuple[int, str, int]:
        """Isolate ``node`` for dry run ``action_id``: the isolation, its ``isolate_node``
        row and the ``approve_action`` row are one transaction, so a database that fails
        leaves the node not isolated and the dry run approvable, and a success is never
        without its record (nor approvable twice)."""
        engine = self._engine
        state = engine.ctx.state.nodes.get(node)
        if state is None:
            raise NotFound(f"node {node!r} of the dry run is not known (any more)")
        if state.isolated_reason is not None:
            raise Conflict(f"node {node!r} is already isolated")
        row = isolation_audit(self._actions, engine, node, actor, reason)

        def audit(ok: bool, outcome: str) -> Callable[[Connection], tuple[int, int | None]]:
            isolated = row(ok, outcome)

            def write(conn: Connection) -> tuple[int, int | None]:
                carried = isolated(conn)
                if not ok:
                    return carried, None
                approval = self._approval(
                    action_id, "isolate_node", actor, carried, "succeeded", f"{reason}: {outcome}"
                )
                return carried, approval(conn)

            return write

        ok, outcome, (carried, approval) = await engine.apply_isolation(
            node, isolate=True, reason=reason, audit=audit
        )
        if not ok or approval is None:
            raise Conflict(f"isolate {node}: {outcome} (action {carried})")
        return carried, outcome, approval

    def _approval(
        self, action_id: int, kind: str, actor: str, carried: int | None, status: str, outcome: str
    ) -> Callable[[Connection], int]:
        return self._actions.inserting(
            kind=APPROVE_KIND,
            target=f"action:{action_id}",
            trigger=f"operator:{actor}",
            params={"action": action_id, "kind": kind, "carried_out": carried},
            status=status,
            outcome=outcome[:2000],
        )

    async def _record(
        self, action_id: int, kind: str, actor: str, carried: int | None, status: str, outcome: str
    ) -> int:
        return await self._store.write(
            self._approval(action_id, kind, actor, carried, status, outcome)
        )


_APPROVALS: weakref.WeakKeyDictionary[RemediationEngine, Approvals] = weakref.WeakKeyDictionary()


def approvals(store: Store, actions: ActionService, engine: RemediationEngine) -> Approvals:
    """The one :class:`Approvals` of this controller (one per engine: its lock serializes
    approvals, so two clicks cannot carry out one dry run twice)."""
    found = _APPROVALS.get(engine)
    if found is None:
        found = _APPROVALS[engine] = Approvals(store, actions, engine)
    return found


__all__ = [
    "APPROVABLE",
    "APPROVE_KIND",
    "Approvals",
    "approvals",
    "isolation_audit",
    "restart_job",
]
