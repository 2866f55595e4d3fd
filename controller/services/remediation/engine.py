"""The remediation engine: open incidents in, recorded actions out.

Every tick the leader looks at the open incidents it has not decided on yet, finds the
policy rule for each, applies the guard rails, and runs the rule's steps as one
*remediation* per job (checkpoint, isolate, restart …), one at a time per job. Every step
is an action row (trigger ``incident:<id>``) written when it starts and updated when it
ends, with its parameters, outcome and duration, so "what did trainguard do, and why?" has
an answer in the API and CLI. In dry-run mode each step is recorded as ``dry_run`` with
what it would have done, and nothing else happens; each step re-reads the policy, so dry
run or ``enabled: false`` also reaches remediations already running (:mod:`.midflight`).

A rule that starts with ``alert`` records it at the incident's first match (once); its other
steps wait until the incident has been open ``after_s`` and costs ``min_cost_pct``. With
``restarts.grow`` on, the tick also restarts jobs left below their first size once healthy
spares are back (a *grow-back*, trigger ``grow:<job>``: checkpoint, then restart).

Decisions survive a failover: an incident that already has an action row is never acted
on again, so a standby that takes over cannot repeat the old leader's work. A remediation
cut in half (its leader killed, or stopped, inside a step) is finished by the next leader:
the step left ``pending`` is closed as ``failed`` (interrupted, outcome unknown, never run
again) and the rule's steps after it run once (:meth:`RemediationEngine._resume`). The
rest of what a new leader must not forget (alerts raised, the restarts counting against
each job's rate limit, each job's original size and its goodput) is read back from the
action rows too (:mod:`controller.services.remediation.history`).

This module decides and sequences; each step is a module of :mod:`.steps` that acts only
through the actuator interface, and grow-backs are :mod:`.grow`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from controller.actuators.base import Actuator, NodeView
from controller.actuators.k8s.partition import PartitionSettings
from controller.logic.remediation import guards
from controller.logic.remediation.params import AlertParams, Severity
from controller.logic.remediation.rules import Policy, Rule, Step
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.events import JobRecordsReported
from controller.services.incidents import IncidentService
from controller.services.nodes import NodeRecords
from controller.services.remediation import approval, history, midflight, partition, restore
from controller.services.remediation.grow import GROW_CHECK_INTERVAL_S, GrowBack
from controller.services.remediation.records import (
    HARDWARE_KINDS,
    JobBook,
    Remediation,
    absorb_note,
    culprit_node,
    dry_plan_for,
    fault_time,
    jobs_of,
)
from controller.services.remediation.retention import engine_retention
from controller.services.remediation.steps import (
    STEP_ACTION_KIND,
    STEPS,
    ActionRecorder,
    StepContext,
    StepResult,
)
from controller.services.remediation.steps import wait as resume_wait
from controller.services.remediation.steps.batch import ready
from controller.services.remediation.steps.isolate import Audit, apply_isolation
from controller.services.webhook import Webhook
from controller.state import ClusterState, IncidentState
from controller.store import Store
from controller.tasks import cancel_and_wait

log = logging.getLogger(__name__)

#: Remediations kept in memory for ``GET /api/v1/remediation``.
RECENT_REMEDIATIONS = 100
#: How far back a new leader looks for a grow-back its predecessor left inside a step.
GROW_LOOKBACK_S = 86_400.0
INTERRUPTED = (
    "interrupted: the leader stopped during this step (failover or shutdown); its outcome is"
    " unknown and it is not run again; the next leader went on with the steps after it"
)


class RemediationEngine:
    """Decides on incidents (a ``Ticker``) and runs remediations as sequences of steps."""

    def __init__(
        self,
        state: ClusterState,
        store: Store,
        incidents: IncidentService,
        commands: CommandService,
        actions: ActionService,
        nodes: NodeRecords,
        actuator: Actuator | None,
        policy: Policy,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        tick_interval_s: float = 1.0,
        grow_check_interval_s: float = GROW_CHECK_INTERVAL_S,
        webhook: Webhook | None = None,
        partition: PartitionSettings | None = None,
        job_retention_s: float = 86_400.0,
    ) -> None:
        self._state = state
        self._store = store
        self._incidents = incidents
        self._recorder = ActionRecorder(actions)
        self._actions = actions
        #: Approvals in flight (``approve``), so two at once cannot both pass the check.
        self._approving: set[int] = set()
        self.ctx = StepContext(
            state=state,
            store=store,
            commands=commands,
            nodes=nodes,
            recorder=self._recorder,
            actuator=actuator,
            policy=policy,
            webhook=webhook,
            incidents=incidents,
            partition=partition or PartitionSettings(),
        )
        self.is_leader = is_leader
        self.tick_interval_s = tick_interval_s
        self.remediations: list[Remediation] = []
        #: Incident id -> what was decided ("acted", "absorbed", "skipped", "no rule" …).
        self.decided: dict[int, str] = self.ctx.decided
        #: Incidents whose rule's ``alert`` is recorded (at most once each), decided or not.
        self.alerted: set[int] = set()
        #: ``node_lost`` incidents held by the partition guard, and why (``partition``).
        self.held: dict[int, str] = {}
        self._loaded = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._grow = GrowBack(self.ctx, self._start_steps, check_interval_s=grow_check_interval_s)
        self.retention = engine_retention(self.ctx, self._grow, job_retention_s)

    # The policy (replaced by ``PUT /api/v1/remediation/policy``) and the actuator live in
    # the steps' context, so a step always sees the current ones.

    @property
    def policy(self) -> Policy:
        return self.ctx.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.ctx.policy = policy

    @property
    def actuator(self) -> Actuator | None:
        return self.ctx.actuator

    @actuator.setter
    def actuator(self, actuator: Actuator | None) -> None:
        self.ctx.actuator = actuator

    @property
    def jobs(self) -> dict[str, JobBook]:
        return self.ctx.jobs

    def book(self, job: str) -> JobBook:
        return self.ctx.book(job)

    async def start(self) -> None:
        """Let the actuator start what it was configured to run (leader only)."""
        await restore.start_configured(self.actuator, self.ctx.original_nodes)

    async def close(self) -> None:
        await self.stop()
        if self.actuator is not None:
            await self.actuator.close()

    # ------------------------------------------------------------------ observing

    async def on_job_records(self, event: JobRecordsReported) -> None:
        """Committed checkpoints and rank 0's steps: for goodput and the resume wait."""
        records, received_unix_s = event.records, event.received_unix_s
        for ckpt in records.checkpoints:
            if ckpt.kind == "committed":  # either tier: complete where a restart loads
                book = self.book(ckpt.job)
                if book.checkpoint is None or ckpt.step >= book.checkpoint[0]:
                    book.checkpoint = (ckpt.step, received_unix_s)
                book.committed(min(ckpt.time_unix_s, received_unix_s))
            elif ckpt.kind == "deleted" and ckpt.job in self.ctx.jobs:  # retention's
                self.ctx.jobs[ckpt.job].deleted(ckpt.step)
        for summary in records.steps:
            if summary.rank != 0:
                continue  # one record per step is enough for goodput and resumption
            book = self.book(summary.job)
            # Never later than its arrival (a clock ahead, a hostile 1e308): kept as a max.
            end = min(summary.end_unix_s or received_unix_s, received_unix_s)
            # Before the step is recorded: the restart's window ends where it begins.
            await resume_wait.step_seen(self.ctx, book, end, summary.step)
            book.ledger.record_step(summary.step, end, summary.step_time_s)
            book.last_step_unix_s = max(book.last_step_unix_s or end, end)

    # ------------------------------------------------------------------ deciding

    async def tick(self, now_unix_s: float) -> None:
        if not self.is_leader():
            return
        if self.policy.enabled and not self._loaded:
            await self._load_decided()
        self.retention.sweep(now_unix_s)  # after the restore: it holds restarts in flight
        self._forget_closed()
        if not self.policy.enabled:
            return
        timeout_s = self.policy.guards.resume_timeout_s
        for rem in resume_wait.expire(self.ctx, now_unix_s):
            # Recorded in the background: the row's write must not hold up the tick.
            self._spawn(resume_wait.note_expired(self.ctx, rem, timeout_s), f"tg-expired-{rem.id}")
        for incident in sorted(self._state.incidents.values(), key=lambda i: i.id):
            if incident.id in self.decided:
                continue
            await self._consider(incident, now_unix_s)
        if self._grow.due(now_unix_s):
            await self._grow.check(now_unix_s, self.decided)

    def _forget_closed(self) -> None:
        """Drop what was decided and alerted for incidents no longer open: only open ones
        are ever looked at (and a new leader loads only theirs), while both kept every
        incident the controller had seen, for good (a closed incident never reopens: a
        condition back after it is a new incident, with a new id)."""
        open_ids = self._state.incidents
        for gone in [i for i in self.decided if i not in open_ids]:
            del self.decided[gone]  # in place: the steps' context shares this dict
        self.alerted.intersection_update(open_ids)

    async def _load_decided(self) -> None:
        """What earlier leaders did (before a failover or restart): incidents already acted
        on, alerts already raised, remediations left inside a step (this leader finishes
        them), and the restarts that count against each job's rate limit."""

        # Only open incidents are ever considered, so only their actions matter: the read
        # stays proportional to what is open, not to the whole action history.
        incident_ids = sorted(self._state.incidents)
        since = time.time() - GROW_LOOKBACK_S

        loaded = await self._store.read(
            lambda session: restore.read_history(session, incident_ids, since)
        )
        actions, restarts, grows = loaded.actions, loaded.restarts, loaded.grows
        starts, newest = loaded.starts, loaded.newest
        interrupted: dict[str, history.IncidentAction] = {}
        for row in actions:
            if row.kind == "alert":
                self.alerted.add(row.incident_id)
            else:
                self.decided[row.incident_id] = "acted before"
            # Only a leader gone inside a remediation's step leaves one of its rows pending;
            # rows without a remediation id were not written by this engine.
            if row.status == "pending" and row.params.get("remediation"):
                interrupted.setdefault(str(row.params["remediation"]), row)
        for restart in restarts:
            self.ctx.restarts.record(restart.job, restart.at_unix_s)
            original = restart.params.get("original_nodes")
            if isinstance(original, int) and original > 0:
                self.ctx.original_nodes[restart.job] = original  # the newest row wins
        for job in sorted({r.job for r in restarts if "goodput" in r.params}):
            ledger = self.book(job).ledger
            if job in starts:
                ledger.started_at(starts[job])
            history.replay(ledger, restarts)
        # Each job's book as its newest restart left it (see :func:`restore.restore_wait`).
        timeout_s, now = self.policy.guards.resume_timeout_s, time.time()
        for job, (newest_row, began) in newest.items():
            rem = restore.restore_wait(self.book(job), job, newest_row, began, timeout_s, now)
            if rem is not None:
                self.remediations.append(rem)
        del self.remediations[:-RECENT_REMEDIATIONS]
        self._loaded = True
        for action_id in grows:
            await self._recorder.finish(action_id, "failed", INTERRUPTED)
        for row in interrupted.values():
            await self._resume(row.id, row.incident_id, row.kind, row.params)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resume(
        self, action_id: int, incident_id: int, kind: str, params: dict[str, Any]
    ) -> None:
        """Close the interrupted step and run the rest of its rule, once.

        The step itself is not repeated: it may have taken effect (a restart whose actuator
        call went through) and its leader's wait is gone with it. A remediation cut between
        two steps (no row ``pending``) is not seen here; that window is one database write.
        """
        await self._recorder.finish(action_id, "failed", INTERRUPTED)
        incident = self._state.incidents.get(incident_id)
        rule = None if incident is None else self.policy.rule_for(incident.kind, incident.severity)
        if incident is None or rule is None:
            return  # resolved meanwhile, or no rule acts on it any more
        kinds = [STEP_ACTION_KIND.get(step) for step in rule.steps]
        if kind not in kinds:
            return
        rest = rule.steps[kinds.index(kind) + 1 :]
        if not rest:
            return
        self.decided[incident_id] = "resumed"
        job = params.get("job")
        job = job if isinstance(job, str) else None
        log.warning(
            "resuming a remediation interrupted by a failover",
            extra={"fields": {"incident": incident_id, "after": kind, "steps": rest}},
        )
        self._launch(incident, rule, rest, job, time.time())

    async def _consider(self, incident: IncidentState, now: float) -> None:
        policy = self.policy
        rule = policy.rule_for(incident.kind, incident.severity)
        if rule is None:
            self.decided[incident.id] = "no rule"
            return
        confirmed = False
        if incident.kind == "node_lost" and incident.node is not None:
            verdict = await partition.judge_silence(
                self._state, incident, self.ctx.partition, self._node_view
            )
            if incident.node not in verdict.act_on:
                await self._hold(incident, rule, verdict.summary)
                return  # unreachable, or mass silence: looked at again next tick
            confirmed = True  # a second signal just agreed: fresh evidence
        jobs = jobs_of(self._state, incident, self.jobs)
        # A job's own incidents raised while trainguard restarts it (ranks stopped, peers
        # timing out) are consequences of that restart; hardware faults never are. Only a
        # restart that happened absorbs: a remediation that checkpointed and then could not
        # restart left the job running as it was, so what opened meanwhile (a straggler the
        # detector will not raise twice) is looked at on its own once that remediation ends.
        absorbable = incident.job is not None and incident.kind not in HARDWARE_KINDS
        for job in jobs:
            book = self.book(job)
            covered = book.covered(incident) if absorbable else None
            if covered is not None and Step.ROLLBACK not in rule.steps:
                await self._absorb(incident, covered, covered=True)
                return
            busy = book.running or book.awaiting_resume
            # A hardware fault on a node the restart in flight moved the job to: that
            # restart cannot resume, so this incident does not wait for its timeout.
            if busy is not None and book.superseded_by(incident) is None:
                restarted = busy.restarted_unix_s is not None
                if absorbable and restarted and incident.opened_unix_s >= busy.started_unix_s:
                    await self._absorb(incident, busy)
                return  # wait until the job's current remediation is over
            since = book.last_remediation_unix_s
            restarted = book.restarted_since(since)
            settled = (book.resumed_unix_s or since or 0.0) + policy.guards.settle_s
            opened_then = since is not None and since <= incident.opened_unix_s < settled
            if absorbable and restarted and opened_then:
                await self._absorb(incident, None)
                return
        reason = None if confirmed else guards.stale(incident.updated_unix_s, now, policy.guards)
        if reason is not None:
            self.decided[incident.id] = "stale"
            await self._recorder.record(incident, None, "skip", "", {}, "skipped", reason)
            return
        actions = rule.actions
        if Step.ALERT in rule.steps and incident.id not in self.alerted:
            await self._alert(incident, rule)
        if not actions:
            self.decided[incident.id] = "alerted"
            return
        if not ready(incident, rule, now):
            return  # too young, too cheap or too short so far: looked at again next tick
        planned = dry_plan_for(self.remediations, incident, self._state, dry_run_now=policy.dry_run)
        if absorbable and planned is not None:
            return  # its node's plan is recorded once: looked at again when that one ends
        self.decided[incident.id] = "acted"
        targets: list[str | None] = list(jobs) or [None]
        for target in targets:
            self._launch(incident, rule, actions, target, now)

    async def _node_view(self, node: str) -> NodeView:
        return NodeView() if self.actuator is None else await self.actuator.node_view(node)

    async def _hold(self, incident: IncidentState, rule: Rule, why: str) -> None:
        """A silent node not (yet) confirmed lost: say so once, act on nothing."""
        if self.held.get(incident.id) == why:
            return
        first = incident.id not in self.held
        self.held[incident.id] = why
        log.warning("node_lost held", extra={"fields": {"incident": incident.id, "why": why}})
        if first and incident.id not in self.alerted:
            self.alerted.add(incident.id)
            params = AlertParams(severity=Severity(incident.severity), then=list(rule.actions))
            outcome = f"held, not acted on: {why}"[:2000]
            await self._recorder.record(
                incident,
                None,
                "alert",
                incident.node or "",
                params.to_params(),
                "succeeded",
                outcome,
            )

    async def _alert(self, incident: IncidentState, rule: Rule) -> None:
        """Record the rule's alert, once per incident (also across a failover)."""
        self.alerted.add(incident.id)
        outcome = incident.summary
        if rule.actions:
            conditions = [f"persists {rule.after_s:g} s"] if rule.after_s > 0 else []
            if rule.min_cost_pct > 0:
                conditions.append(f"costs >= {rule.min_cost_pct:g} % of job throughput")
            if rule.min_bad_steps > 0:
                conditions.append(f"lasts {rule.min_bad_steps} steps")
            outcome += f"; then {', '.join(rule.actions)}" + (
                f" if it {' and '.join(conditions)}" if conditions else ""
            )
        await self._recorder.record(
            incident,
            None,
            "alert",
            incident.job or incident.node or "",
            AlertParams(
                severity=Severity(incident.severity), then=[str(s) for s in rule.actions]
            ).to_params(),
            "succeeded",
            outcome[:2000],
        )

    def _launch(
        self,
        incident: IncidentState,
        rule: Rule,
        steps: list[Step],
        job: str | None,
        now: float,
        approved_by: str | None = None,
    ) -> Remediation:
        """Run ``steps`` of ``rule`` for one job (or none) as a background remediation."""
        rem = Remediation(
            id=uuid.uuid4().hex[:12],
            incident_id=incident.id,
            incident_kind=incident.kind,
            job=job,
            node=culprit_node(incident),
            steps=[str(s) for s in steps],
            started_unix_s=now,
            dry_run=self.policy.dry_run,
            trigger=f"incident:{incident.id}",
            approved_by=approved_by,
        )
        if job is not None:
            book = self.book(job)
            book.ledger.fault(fault_time(incident), str(incident.id), incident.kind)
            book.ledger.detected(incident.opened_unix_s, str(incident.id))
        self._start(rem, self._run(rem, incident, rule, steps))
        return rem

    def _start_steps(self, rem: Remediation, steps: list[Step]) -> None:
        """Run ``steps`` for ``rem`` with no incident (a grow-back)."""
        self._start(rem, self._run(rem, None, None, steps))

    def _start(self, rem: Remediation, run: Coroutine[Any, Any, None]) -> None:
        """Make ``rem`` its job's running remediation and run it in the background."""
        self.remediations.append(rem)
        del self.remediations[:-RECENT_REMEDIATIONS]
        if rem.job is not None:
            book = self.book(rem.job)
            book.running = rem
            book.last_remediation_unix_s = rem.started_unix_s
        self._spawn(run, f"tg-rem-{rem.id}")

    async def _absorb(
        self, incident: IncidentState, by: Remediation | None, *, covered: bool = False
    ) -> None:
        self.decided[incident.id] = "absorbed"
        if incident.job is not None and incident.kind not in HARDWARE_KINDS:
            await self._incidents.resolve(incident, note=absorb_note(incident, by, covered=covered))

    # ------------------------------------------------------------------ acting

    async def _run(
        self,
        rem: Remediation,
        incident: IncidentState | None,
        rule: Rule | None,
        steps: list[Step],
    ) -> None:
        """The state machine: run the steps in order; a failed restart or rollback fails the
        remediation, any other step's outcome is reported and the next step runs."""
        failed = ""
        try:
            # The job's own policy (its steps, its dry run) narrows the rule for this job.
            own = await approval.apply_job_policy(self.ctx, rem, incident, steps)
            if own is None:
                failed = rem.outcome
            todo = own or []
            for i, step in enumerate(todo):
                # The policy in force now (dry run, or off since): :mod:`.midflight`.
                if not await midflight.go_on(self.ctx, rem, incident, todo[i:]):
                    return
                ok, outcome = await self._step(step, rem, incident, rule)
                rem.outcome = outcome
                if not ok and step in (Step.RESTART, Step.ROLLBACK):
                    failed = outcome
            if own is not None and rem.awaiting_approval and incident is not None:
                await approval.record_plan(self.ctx, rem, incident, own)
                rem.outcome = f"planned {', '.join(own)}; awaiting approval"
        except Exception as exc:  # a remediation must never take the engine down
            log.exception("remediation failed", extra={"fields": {"remediation": rem.id}})
            failed = f"{type(exc).__name__}: {exc}"
        finally:
            rem.finished_unix_s = time.time()
            rem.state = "failed" if failed else "done"
            if failed:
                rem.outcome = failed
            if rem.job is not None:
                book = self.book(rem.job)
                book.running = None
                if rem.restarted_unix_s is None:  # no restart: the incident's cost ends here
                    book.ledger.closed(rem.finished_unix_s, rem.ledger_id)

    async def _step(
        self, step: Step, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        handler = STEPS.get(step)
        if handler is None:
            return True, ""
        return await handler.run(self.ctx, rem, incident, rule)

    async def apply_isolation(
        self, node: str, *, isolate: bool, reason: str, audit: Audit
    ) -> tuple[bool, str, Any]:
        """Isolate or release ``node`` by hand (the API): the same path as the policy's,
        with ``audit`` (the operator's action rows) in the isolation's transaction."""
        return await apply_isolation(self.ctx, node, isolate=isolate, reason=reason, audit=audit)

    async def approve(self, action_id: int, actor: str) -> dict[str, Any]:
        """Run the plan a job's dry run held back (an ``approval`` row), once, as ``actor``.

        The row is marked approved before anything runs, so a repeated approval is refused
        (:class:`~.approval.ApprovalError`, one line with an HTTP status). Returns the
        remediation started (:meth:`Remediation.public`)."""
        if not self.is_leader():
            raise approval.ApprovalError("this replica is not the leader", 503)
        if not actor.strip():
            raise approval.ApprovalError("an approval needs the approver's name", 400)
        if action_id in self._approving:
            raise approval.ApprovalError(f"action {action_id} is being approved already")
        self._approving.add(action_id)
        try:
            row = await self._store.read(lambda s: approval.read_action(s, action_id))
            incident, rule, steps, job = approval.check_approvable(
                row, action_id, self._state, self.policy
            )
            book = self.book(job)
            if book.running is not None or book.awaiting_resume is not None:
                raise approval.ApprovalError(
                    f"job {job} is being remediated now; approve again when that is over"
                )
            assert row is not None
            await self._actions.update(
                action_id,
                params=approval.approved_params(row["params"], actor),
                status="succeeded",
                outcome=f"approved by {actor}",
                finished_unix_s=time.time(),
            )
        finally:
            self._approving.discard(action_id)
        log.warning(
            "running an approved remediation plan",
            extra={"fields": {"action": action_id, "by": actor, "job": job, "steps": steps}},
        )
        rem = self._launch(incident, rule, steps, job, time.time(), approved_by=actor)
        return rem.public()

    async def stop(self) -> None:
        await cancel_and_wait(list(self._tasks))

    # ------------------------------------------------------------------ views

    def ettr(self, job: str) -> float | None:
        """The job's goodput now (effective training time ratio), from its ledger."""
        book = self.jobs.get(job)
        value = None if book is None else book.ledger.snapshot().get("ettr")
        return float(value) if isinstance(value, int | float) else None

    def isolated_nodes(self) -> list[str]:
        return sorted(n.name for n in self._state.nodes.values() if n.isolated_reason is not None)

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": self.policy.enabled,
            "dry_run": self.policy.dry_run,
            "leader": self.is_leader(),
            "actuator": self.actuator.name if self.actuator else None,
            "remediations": [r.public() for r in reversed(self.remediations)],
            "isolated_nodes": self.isolated_nodes(),
            "held": {str(i): why for i, why in self.held.items() if i in self._state.incidents},
        }
