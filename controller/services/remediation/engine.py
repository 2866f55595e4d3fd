"""The remediation engine: open incidents in, recorded actions out.

Every tick the leader looks at the open incidents it has not decided on yet, finds the
policy rule for each, applies the guard rails, and runs the rule's steps as one
*remediation* per job (checkpoint, isolate, restart …), one at a time per job. Every step
is an action row (trigger ``incident:<id>``) written when it starts and updated when it
ends, with its parameters, outcome and duration, so "what did trainguard do, and why?" has
an answer in the API and CLI. In dry-run mode each step is recorded as ``dry_run`` with
what it would have done, and nothing else happens.

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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import Connection, update
from sqlalchemy.orm import Session

from controller.actuators.base import Actuator, ActuatorError, Placement
from controller.actuators.local import LocalJobSpec, LocalProcessActuator
from controller.db.models import Node
from controller.logic.remediation import guards
from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.planner import RestartPlan, plan_restart
from controller.logic.remediation.rules import IsolateWhen, Policy, Rule, Step
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService
from controller.services.remediation import history
from controller.services.remediation.records import JobBook, Remediation, culprit_node, fault_time
from controller.state import ClusterState, IncidentState
from controller.store import Store
from trainguard import wire

log = logging.getLogger(__name__)

#: Incident kinds that are hardware evidence against the node they name.
HARDWARE_KINDS = frozenset({"gpu_fault", "node_lost"})
#: Remediations kept in memory for ``GET /api/v1/remediation``.
RECENT_REMEDIATIONS = 100
#: How often the leader looks for jobs to grow back (``restarts.grow``): each look asks the
#: actuator where the job runs, a Kubernetes API call.
GROW_CHECK_INTERVAL_S = 5.0
#: How far back a new leader looks for a grow-back its predecessor left inside a step.
GROW_LOOKBACK_S = 86_400.0
#: The action kind each step records, to find where an interrupted remediation stopped.
STEP_ACTION_KIND = {
    Step.CAPTURE_EVIDENCE: "capture_evidence",
    Step.CHECKPOINT: "checkpoint",
    Step.ISOLATE: "isolate_node",
    Step.RESTART: "restart_job",
    Step.ROLLBACK: "restart_job",  # a restart from an older step: the same budget and ledger
}
INTERRUPTED = (
    "interrupted: the leader stopped during this step (failover or shutdown); its outcome is"
    " unknown and it is not run again; the next leader went on with the steps after it"
)


class RemediationEngine:
    """``ReportObserver`` + ``Ticker``: decides on incidents and runs remediations."""

    def __init__(
        self,
        state: ClusterState,
        store: Store,
        incidents: IncidentService,
        commands: CommandService,
        actions: ActionService,
        actuator: Actuator | None,
        policy: Policy,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        tick_interval_s: float = 1.0,
    ) -> None:
        self._state = state
        self._store = store
        self._incidents = incidents
        self._commands = commands
        self._actions = actions
        self.actuator = actuator
        self.policy = policy
        self.is_leader = is_leader
        self.tick_interval_s = tick_interval_s
        self.jobs: dict[str, JobBook] = {}
        self.remediations: list[Remediation] = []
        #: Incident id -> what was decided ("acted", "absorbed", "skipped", "no rule" …).
        self.decided: dict[int, str] = {}
        #: Incidents whose rule's ``alert`` is recorded (at most once each), decided or not.
        self.alerted: set[int] = set()
        self._loaded = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._restarts = guards.RestartBudget()
        #: Jobs the local actuator launches when this replica starts leading.
        self.local_jobs: list[tuple[LocalJobSpec, Placement]] = []
        #: Node count of each job's first placement (the size ``grow`` returns to).
        self._original_nodes: dict[str, int] = {}
        self._grow_checked_unix_s = 0.0
        #: Job -> the grow-back placement last recorded as refused or dry run (recorded once).
        self._grow_noted: dict[str, str] = {}

    async def start(self) -> None:
        """Launch the configured local jobs (leader only; their processes are ours)."""
        actuator = self.actuator
        if not isinstance(actuator, LocalProcessActuator):
            return
        for spec, placement in self.local_jobs:
            actuator.register(spec)
            if await actuator.current_placement(spec.name) is None:
                self._original_nodes[spec.name] = len(placement.nodes)
                result = await actuator.launch(placement)
                log.info(
                    "local job launched",
                    extra={"fields": {"job": spec.name, "outcome": result.outcome}},
                )

    async def close(self) -> None:
        await self.stop()
        if self.actuator is not None:
            await self.actuator.close()

    def _limits(self, job: str) -> tuple[int, int | None]:
        """(min_dp, dp_must_divide) for a job: the policy's, tightened by a local spec."""
        restarts = self.policy.restarts
        min_dp, divide = restarts.min_dp, restarts.dp_must_divide
        if isinstance(self.actuator, LocalProcessActuator):
            try:
                spec = self.actuator.spec(job)
            except ActuatorError:
                return min_dp, divide
            min_dp = max(min_dp, spec.min_dp)
            divide = spec.dp_must_divide or divide
        return min_dp, divide

    # ------------------------------------------------------------------ observing

    def book(self, job: str) -> JobBook:
        book = self.jobs.get(job)
        if book is None:
            book = self.jobs[job] = JobBook(ledger=GoodputLedger(job))
        return book

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        records = report.job
        if records.is_empty():
            return
        for ckpt in records.checkpoints:
            if ckpt.kind == "committed":
                book = self.book(ckpt.job)
                if book.checkpoint is None or ckpt.step >= book.checkpoint[0]:
                    book.checkpoint = (ckpt.step, received_unix_s)
        for summary in records.steps:
            if summary.rank != 0:
                continue  # one record per step is enough for goodput and resumption
            book = self.book(summary.job)
            end = summary.end_unix_s or received_unix_s
            waiting = book.awaiting_resume
            if (
                waiting is not None
                and waiting.restarted_unix_s is not None
                and end > waiting.restarted_unix_s
            ):
                # Before the step is recorded: the restart's window ends where it begins.
                self._resumed(book, waiting, end, summary.step)
                await self._note_resumed(waiting, end, summary.step)
            book.ledger.record_step(summary.step, end, summary.step_time_s)

    def _resumed(self, book: JobBook, rem: Remediation, at: float, step: int) -> None:
        book.awaiting_resume = None
        book.resumed_unix_s = at
        rem.resumed_unix_s = at
        book.ledger.resumed(at)
        lost = at - rem.started_unix_s
        log.info(
            "job resumed",
            extra={
                "fields": {
                    "job": rem.job,
                    "remediation": rem.id,
                    "generation": rem.generation,
                    "step": step,
                    "since_remediation_s": round(lost, 2),
                }
            },
        )

    async def _note_resumed(self, rem: Remediation, at: float, step: int) -> None:
        """Add when the job resumed to its restart's row: the goodput a new leader rebuilds
        (:func:`history.replay`) needs it, and an operator sees the time to recover."""
        if rem.restart_action is None or rem.restart_params is None:
            return
        params = dict(rem.restart_params)
        params["goodput"] = {
            **params.get("goodput", {}),
            "restart_unix_s": rem.restarted_unix_s,
            "resumed_unix_s": at,
        }
        params["resumed_step"] = step
        try:
            await self._actions.update(rem.restart_action, params=params)
        except Exception:  # the record is a nicety; the ingest path must go on
            log.exception("could not record a resumption", extra={"fields": {"rem": rem.id}})

    # ------------------------------------------------------------------ deciding

    async def tick(self, now_unix_s: float) -> None:
        if not self.is_leader() or not self.policy.enabled:
            return
        if not self._loaded:
            await self._load_decided()
        for book in self.jobs.values():
            waiting = book.awaiting_resume
            if (
                waiting is not None
                and waiting.restarted_unix_s is not None
                and now_unix_s - waiting.restarted_unix_s > self.policy.guards.resume_timeout_s
            ):
                book.awaiting_resume = None
                waiting.state = "failed"
                waiting.outcome = (
                    f"job {waiting.job} did not step within "
                    f"{self.policy.guards.resume_timeout_s:.0f} s of its restart"
                )
                log.error("job did not resume", extra={"fields": {"remediation": waiting.id}})
        for incident in sorted(self._state.incidents.values(), key=lambda i: i.id):
            if incident.id in self.decided:
                continue
            await self._consider(incident, now_unix_s)
        if self.policy.restarts.grow and now_unix_s - self._grow_checked_unix_s >= (
            GROW_CHECK_INTERVAL_S
        ):
            self._grow_checked_unix_s = now_unix_s
            await self._check_grow(now_unix_s)

    async def _load_decided(self) -> None:
        """What earlier leaders did (before a failover or restart): incidents already acted
        on, alerts already raised, remediations left inside a step (this leader finishes
        them), and the restarts that count against each job's rate limit."""

        # Only open incidents are ever considered, so only their actions matter: the read
        # stays proportional to what is open, not to the whole action history.
        incident_ids = sorted(self._state.incidents)
        since = time.time() - GROW_LOOKBACK_S

        def read(
            session: Session,
        ) -> tuple[
            list[history.IncidentAction], list[history.RestartRow], list[int], dict[str, float]
        ]:
            restarts = history.restarts(session)
            jobs = sorted({r.job for r in restarts if "goodput" in r.params})
            return (
                history.incident_actions(session, incident_ids),
                restarts,
                history.interrupted_grows(session, since),
                history.job_starts(session, jobs),
            )

        actions, restarts, grows, starts = await self._store.read(read)
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
            self._restarts.record(restart.job, restart.at_unix_s)
            original = restart.params.get("original_nodes")
            if isinstance(original, int) and original > 0:
                self._original_nodes[restart.job] = original  # the newest row wins
        for job in sorted({r.job for r in restarts if "goodput" in r.params}):
            ledger = self.book(job).ledger
            if job in starts:
                ledger.started_at(starts[job])
            history.replay(ledger, restarts)
        self._loaded = True
        for action_id in grows:
            await self._finish(action_id, "failed", INTERRUPTED)
        for row in interrupted.values():
            await self._resume(row.id, row.incident_id, row.kind, row.params)

    async def _resume(
        self, action_id: int, incident_id: int, kind: str, params: dict[str, Any]
    ) -> None:
        """Close the interrupted step and run the rest of its rule, once.

        The step itself is not repeated: it may have taken effect (a restart whose actuator
        call went through) and its leader's wait is gone with it. A remediation cut between
        two steps (no row ``pending``) is not seen here; that window is one database write.
        """
        await self._finish(action_id, "failed", INTERRUPTED)
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
        jobs = self._jobs_of(incident)
        # A job's own incidents raised while trainguard restarts it (ranks stopped, peers
        # timing out) are consequences of that restart; hardware faults never are.
        absorbable = incident.job is not None and incident.kind not in HARDWARE_KINDS
        for job in jobs:
            book = self.book(job)
            busy = book.running or book.awaiting_resume
            if busy is not None:
                if absorbable and incident.opened_unix_s >= busy.started_unix_s:
                    await self._absorb(incident, busy)
                return  # wait until the job's current remediation is over
            since = book.last_remediation_unix_s
            settled = (book.resumed_unix_s or since or 0.0) + policy.guards.settle_s
            if absorbable and since is not None and since <= incident.opened_unix_s < settled:
                await self._absorb(incident, None)
                return
        reason = guards.stale(incident.updated_unix_s, now, policy.guards)
        if reason is not None:
            self.decided[incident.id] = "stale"
            await self._record(incident, None, "skip", "", {}, "skipped", reason)
            return
        actions = rule.actions
        if Step.ALERT in rule.steps and incident.id not in self.alerted:
            await self._alert(incident, rule)
        if not actions:
            self.decided[incident.id] = "alerted"
            return
        if now - incident.opened_unix_s < rule.after_s:
            return  # not persisted long enough yet
        if rule.min_cost_pct > 0:
            cost = incident.evidence.get("slowdown_pct")
            if not isinstance(cost, int | float) or cost < rule.min_cost_pct:
                return  # cheap so far; it may grow while the incident stays open
        if rule.min_bad_steps > 0:
            bad = incident.evidence.get("bad_steps")
            if not isinstance(bad, int) or bad < rule.min_bad_steps:
                return  # possibly a skipped overflow; a diverged job adds one per step
        self.decided[incident.id] = "acted"
        targets: list[str | None] = list(jobs) or [None]
        for target in targets:
            self._launch(incident, rule, actions, target, now)

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
        await self._record(
            incident,
            None,
            "alert",
            incident.job or incident.node or "",
            {"severity": incident.severity, "then": [str(s) for s in rule.actions]},
            "succeeded",
            outcome[:2000],
        )

    def _launch(
        self, incident: IncidentState, rule: Rule, steps: list[Step], job: str | None, now: float
    ) -> None:
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
        )
        if job is not None:
            book = self.book(job)
            book.ledger.fault(fault_time(incident), str(incident.id), incident.kind)
            book.ledger.detected(incident.opened_unix_s, str(incident.id))
        self._start(rem, self._run(rem, incident, rule, steps))

    def _start(self, rem: Remediation, run: Coroutine[Any, Any, None]) -> None:
        """Make ``rem`` its job's running remediation and run it in the background."""
        self.remediations.append(rem)
        del self.remediations[:-RECENT_REMEDIATIONS]
        if rem.job is not None:
            book = self.book(rem.job)
            book.running = rem
            book.last_remediation_unix_s = rem.started_unix_s
        task = asyncio.create_task(run, name=f"tg-rem-{rem.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _absorb(self, incident: IncidentState, by: Remediation | None) -> None:
        self.decided[incident.id] = "absorbed"
        note = (
            f"absorbed: a consequence of remediation {by.id} of job {by.job}"
            if by is not None
            else "absorbed: raised while the job settled after a restart trainguard made"
        )
        if incident.job is not None and incident.kind not in HARDWARE_KINDS:
            await self._incidents.resolve(incident, note=note)

    def _jobs_of(self, incident: IncidentState) -> list[str]:
        if incident.job is not None:
            return [incident.job]
        if incident.node is None:
            return []
        return sorted(
            job.name
            for job in self._state.jobs.values()
            if any(r.node == incident.node and r.state == "running" for r in job.ranks.values())
        )

    # ------------------------------------------------------------------ acting

    async def _run(
        self,
        rem: Remediation,
        incident: IncidentState | None,
        rule: Rule | None,
        steps: list[Step],
    ) -> None:
        failed = ""
        try:
            for step in steps:
                ok, outcome = await self._step(step, rem, incident, rule)
                rem.outcome = outcome
                if not ok and step in (Step.RESTART, Step.ROLLBACK):
                    failed = outcome
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
    ) -> tuple[bool, str]:
        if step is Step.CAPTURE_EVIDENCE:
            return await self._capture(rem, incident)
        if step is Step.CHECKPOINT:
            return await self._checkpoint(rem, incident)
        if step is Step.ISOLATE and incident is not None and rule is not None:
            return await self._isolate(rem, incident, rule)
        if step is Step.RESTART:
            return await self._restart(rem, incident)
        if step is Step.ROLLBACK:
            return await self._rollback(rem, incident)
        return True, ""

    async def _record(
        self,
        incident: IncidentState | None,
        rem: Remediation | None,
        kind: str,
        target: str,
        params: dict[str, Any],
        status: str,
        outcome: str,
    ) -> int:
        """One action row, triggered by ``incident`` or (grow-back) by ``rem`` alone."""
        full = self._params(incident, rem, params)
        if rem is not None and rem.trigger:
            trigger = rem.trigger
        elif incident is not None:
            trigger = f"incident:{incident.id}"
        else:
            raise ValueError("an action needs an incident or a remediation to name its trigger")
        return await self._actions.create(
            kind=kind,
            target=target,
            trigger=trigger,
            params=full,
            status=status,
            outcome=outcome,
        )

    @staticmethod
    def _params(
        incident: IncidentState | None, rem: Remediation | None, params: dict[str, Any]
    ) -> dict[str, Any]:
        """An action row's parameters: its own, with what triggered it."""
        full = {} if incident is None else {"incident": incident.id, "incident_kind": incident.kind}
        full |= params
        if rem is not None:
            # The job too: a leader that finishes this remediation after a failover needs it.
            full |= {"remediation": rem.id, "job": rem.job}
        return full

    async def _finish(self, action_id: int, status: str, outcome: str) -> None:
        await self._actions.update(
            action_id, status=status, outcome=outcome, finished_unix_s=time.time()
        )

    async def _capture(self, rem: Remediation, incident: IncidentState | None) -> tuple[bool, str]:
        job = self._state.jobs.get(rem.job or "")
        ranks: list[dict[str, Any]] = []
        if job is not None:
            for r in sorted(job.ranks.values(), key=lambda r: r.rank):
                ranks.append(
                    {
                        "rank": r.rank,
                        "node": r.node,
                        "state": r.state,
                        "last_step": r.last_step,
                        "inflight": [
                            {"op": c.op, "seq": c.seq, "group": c.group} for c in r.inflight[:4]
                        ],
                    }
                )
        status = "dry_run" if rem.dry_run else "succeeded"
        outcome = f"captured the state of {len(ranks)} ranks"
        await self._record(
            incident, rem, "capture_evidence", rem.job or "", {"ranks": ranks}, status, outcome
        )
        return True, outcome

    async def _checkpoint(
        self, rem: Remediation, incident: IncidentState | None
    ) -> tuple[bool, str]:
        job_name = rem.job
        job = self._state.jobs.get(job_name or "")
        nodes = sorted({r.node for r in job.ranks.values() if r.state == "running"}) if job else []
        if job_name is None or not nodes:
            await self._record(
                incident, rem, "checkpoint", job_name or "", {}, "skipped", "no running ranks"
            )
            return True, "no running ranks to checkpoint"
        book = self.book(job_name)
        before = book.checkpoint
        params = {"nodes": nodes, "before_step": before[0] if before else None}
        if rem.dry_run:
            await self._record(
                incident, rem, "checkpoint", job_name, params, "dry_run",
                f"would ask {len(nodes)} nodes for a checkpoint of job {job_name}",
            )  # fmt: skip
            return True, "dry run"
        action = await self._record(incident, rem, "checkpoint", job_name, params, "pending", "")
        asked = time.time()
        for node in nodes:
            request = wire.JobCheckpoint(id="assigned-by-server", job=job_name, reason=rem.id)
            await self._commands.create(node, request, by="remediation")
        deadline = asked + self.policy.guards.checkpoint_timeout_s
        while time.time() < deadline:
            latest = book.checkpoint
            if latest is not None and latest[1] >= asked and latest != before:
                took = latest[1] - asked
                outcome = f"checkpoint of step {latest[0]} durable after {took:.1f} s"
                await self._finish(action, "succeeded", outcome)
                return True, outcome
            await asyncio.sleep(0.2)
        fallback = f"step {before[0]}" if before else "no checkpoint"
        outcome = (
            f"no durable checkpoint within {self.policy.guards.checkpoint_timeout_s:.0f} s; "
            f"going on from the newest complete one ({fallback})"
        )
        await self._finish(action, "failed", outcome)
        return False, outcome

    def _hardware_evidence(self, incident: IncidentState, node: str) -> bool:
        if incident.kind in HARDWARE_KINDS:
            return True
        if incident.evidence.get("causes"):
            return True  # the straggler's GPU is throttled, hot, or reports ECC errors
        state = self._state.nodes.get(node)
        return state is not None and (state.health != "healthy" or state.gpus_unhealthy > 0)

    async def _isolate(
        self, rem: Remediation, incident: IncidentState, rule: Rule
    ) -> tuple[bool, str]:
        node = rem.node
        now = time.time()
        if node is None:
            outcome = "no single culprit node to isolate"
            await self._record(incident, rem, "isolate_node", "", {}, "skipped", outcome)
            return True, outcome
        book = self.book(rem.job) if rem.job else None
        history = book.culprits.setdefault(node, []) if book else []
        window = self.policy.guards.repeat_window_s
        repeat = any(now - t <= window for t in history)
        history.append(now)
        if rule.isolate_when is IsolateWhen.HARDWARE_OR_REPEAT and not (
            self._hardware_evidence(incident, node) or repeat
        ):
            outcome = (
                f"not isolating {node}: no hardware evidence and its first offence "
                f"in {window:.0f} s"
            )
            await self._record(incident, rem, "isolate_node", node, {}, "skipped", outcome)
            return True, outcome
        node_state = self._state.nodes.get(node)
        if node_state is not None and node_state.isolated_reason is not None:
            outcome = f"{node} is already isolated"
            await self._record(incident, rem, "isolate_node", node, {}, "succeeded", outcome)
            return True, outcome
        refused = guards.circuit_breaker(
            node,
            isolated_since=[n.isolated_unix_s for n in self._state.nodes.values()],
            known_nodes=len(self._state.nodes),
            now_unix_s=now,
            guards=self.policy.guards,
        )
        if refused is not None:
            await self._record(incident, rem, "isolate_node", node, {}, "skipped", refused)
            return False, refused
        reason = f"incident {incident.id} ({incident.kind}): {incident.summary}"[:500]
        if rem.dry_run:
            outcome = f"would isolate {node}"
            await self._record(incident, rem, "isolate_node", node, {}, "dry_run", outcome)
            return True, outcome
        params = {"actuator": self.actuator.name if self.actuator else None}
        action = await self._record(incident, rem, "isolate_node", node, params, "pending", "")
        ok, outcome = await self.apply_isolation(node, isolate=True, reason=reason)
        await self._finish(action, "succeeded" if ok else "failed", outcome)
        return ok, outcome

    async def apply_isolation(self, node: str, *, isolate: bool, reason: str) -> tuple[bool, str]:
        """Isolate or release ``node`` through the actuator, then record it: the one path
        for the policy and for operators. Returns (done, outcome)."""
        outcome = f"{node} {'isolated' if isolate else 'released'}"
        if self.actuator is not None:
            call = self.actuator.isolate_node if isolate else self.actuator.release_node
            try:
                outcome = (await call(node, reason=reason)).outcome
            except ActuatorError as exc:
                return False, str(exc)
        await self._set_isolation(node, reason if isolate else None)
        return True, outcome

    async def _set_isolation(self, node: str, reason: str | None) -> None:
        """Record (or clear, with ``None``) a node's isolation, durably and in memory."""
        state = self._state.nodes.get(node)
        at = time.time() if reason is not None else None
        if state is not None:
            state.isolated_reason, state.isolated_unix_s = reason, at

        def write(conn: Connection) -> None:
            conn.execute(
                update(Node)
                .where(Node.name == node)
                .values(isolated_reason=reason, isolated_unix_s=at)
            )

        await self._store.write(write)

    def _excluded(self, candidates: list[str], current: Placement, *, grow_back: bool) -> set[str]:
        """Nodes a restart must not use: isolated, unhealthy and lost ones. A grow-back is
        stricter: a spare it adds must be known healthy (its agent reports it so)."""
        excluded = {
            n.name
            for n in self._state.nodes.values()
            if n.isolated_reason is not None or n.health in ("unhealthy", "lost")
        }
        if grow_back:
            for name in candidates:
                node = self._state.nodes.get(name)
                if name not in current.nodes and (node is None or node.health != "healthy"):
                    excluded.add(name)
        return excluded

    async def _plan(
        self, job: str, current: Placement, *, grow_back: bool, resume_step: int | None = None
    ) -> RestartPlan:
        """The next placement of ``job``; ``grow_back``: only healthy spares are added.
        ``resume_step``: the checkpoint to resume from (default: the newest committed)."""
        assert self.actuator is not None
        candidates = await self.actuator.candidate_nodes(job)
        book = self.book(job)
        min_dp, divide = self._limits(job)
        self._original_nodes.setdefault(job, len(current.nodes))
        return plan_restart(
            current,
            candidates,
            self._excluded(candidates, current, grow_back=grow_back),
            min_dp=min_dp,
            dp_must_divide=divide,
            original_nodes=self._original_nodes[job],
            grow=self.policy.restarts.grow or grow_back,
            resume_step=resume_step
            if resume_step is not None
            else (book.checkpoint[0] if book.checkpoint else None),
        )

    async def _rollback(self, rem: Remediation, incident: IncidentState | None) -> tuple[bool, str]:
        """Restart from the newest checkpoint committed before the incident's first bad step.

        The committed steps come from the database (the agents' checkpoint events), not from
        memory, so a leader that took over after the NaN still finds them.
        """
        job = rem.job
        if job is None:
            return True, "no job to roll back"
        bad = incident.evidence.get("step") if incident is not None else None
        if not isinstance(bad, int) or isinstance(bad, bool):
            outcome = (
                "the incident names no step where the damage began: nothing to roll back "
                "to; restart the job by hand from a checkpoint you trust"
            )
            await self._record(incident, rem, "restart_job", job, {}, "skipped", outcome)
            return False, outcome
        clean = await self._store.read(
            lambda session: history.newest_committed_before(session, job, bad)
        )
        params = {"rollback": {"bad_step": bad}}
        if clean is None:
            outcome = (
                f"no checkpoint of job {job} was committed before step {bad}: nothing clean "
                "to roll back to; the job keeps running, decide by hand"
            )
            await self._record(incident, rem, "restart_job", job, params, "skipped", outcome)
            return False, outcome
        return await self._restart(rem, incident, resume_step=clean, extra=params)

    async def _restart(
        self,
        rem: Remediation,
        incident: IncidentState | None,
        *,
        resume_step: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[bool, str]:
        """Restart ``rem``'s job without excluded nodes, from ``resume_step`` (default: the
        newest committed checkpoint); ``extra`` goes into the action's parameters."""
        job = rem.job
        now = time.time()
        if job is None:
            return True, "no job to restart"
        refused = self._restarts.refuse(job, now, self.policy.guards)
        if refused is not None:
            await self._record(incident, rem, "restart_job", job, {}, "skipped", refused)
            return False, refused
        if self.actuator is None:
            outcome = "no actuator configured: restart the job by hand"
            await self._record(incident, rem, "restart_job", job, {}, "skipped", outcome)
            return False, outcome
        current = await self.actuator.current_placement(job)
        if current is None:
            outcome = f"job {job} is not managed by the {self.actuator.name} actuator"
            await self._record(incident, rem, "restart_job", job, {}, "skipped", outcome)
            return False, outcome
        book = self.book(job)
        plan = await self._plan(job, current, grow_back=rem.grow, resume_step=resume_step)
        placement = plan.placement
        resume_step = placement.resume_step if placement is not None else None
        params: dict[str, Any] = dict(extra or {}) | {
            "plan": plan.kind,
            "reason": plan.reason,
            "from_nodes": list(current.nodes),
            "from_world_size": current.world_size,
            "original_nodes": self._original_nodes[job],
            "resume_step": resume_step,
        }
        if placement is None:
            await self._record(incident, rem, "restart_job", job, params, "failed", plan.reason)
            return False, plan.reason
        if rem.grow and (plan.kind != "grow" or plan.replaced or plan.dropped):
            outcome = f"not grown: capacity is gone again ({plan.reason})"
            await self._record(incident, rem, "restart_job", job, params, "skipped", outcome)
            return True, outcome
        params |= {
            "nodes": list(placement.nodes),
            "world_size": placement.world_size,
            "tp": placement.tp,
            "dp": placement.dp,
            "generation": placement.generation,
        }
        summary = (
            f"{plan.kind}: world {current.world_size} -> {placement.world_size} on "
            f"{', '.join(placement.nodes)}, from "
            f"{'step ' + str(resume_step) if resume_step is not None else 'the start'}"
        )
        if rem.dry_run:
            await self._record(
                incident, rem, "restart_job", job, params, "dry_run", "would restart: " + summary
            )
            return True, summary
        last_step = book.ledger.high_water_step
        params["goodput"] = {
            "ledger_id": rem.ledger_id,
            "kind": incident.kind if incident is not None else "grow",
            "fault_unix_s": fault_time(incident) if incident else rem.started_unix_s,
            "detected_unix_s": incident.opened_unix_s if incident else rem.started_unix_s,
            "last_step": last_step if last_step is not None else 0,
            "resume_step": resume_step if resume_step is not None else 0,
            "step_s": book.ledger.median_step_s(),
        }
        action = await self._record(incident, rem, "restart_job", job, params, "pending", "")
        try:
            result = await self.actuator.restart_job(placement, reason=f"remediation {rem.id}")
        except ActuatorError as exc:
            await self._finish(action, "failed", str(exc))
            return False, str(exc)
        started = time.time()
        self._restarts.record(job, started)
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
        rem.restart_params = self._params(incident, rem, params)
        book.awaiting_resume = rem
        await self.actuator.record_event(
            target=job, reason="TrainguardRestart", message=summary, warning=True
        )
        await self._finish(action, "succeeded", f"{summary}; {result.outcome}")
        return True, summary

    # ------------------------------------------------------------------ growing back

    async def _check_grow(self, now: float) -> None:
        """Restart jobs running below their first size once healthy spares are back."""
        if self.actuator is None:
            return
        for job, original in sorted(self._original_nodes.items()):
            try:
                await self._consider_grow(job, original, now)
            except ActuatorError as exc:
                log.warning(
                    "grow-back check failed", extra={"fields": {"job": job, "error": str(exc)}}
                )

    async def _consider_grow(self, job: str, original: int, now: float) -> None:
        assert self.actuator is not None
        book = self.book(job)
        if book.running is not None or book.awaiting_resume is not None:
            return  # an action in flight: grow once it is over
        if any(i.job == job and i.id not in self.decided for i in self._state.incidents.values()):
            return  # an incident of the job waits for a decision: it comes first
        since = book.last_remediation_unix_s
        if since is not None and now < (book.resumed_unix_s or since) + self.policy.guards.settle_s:
            return
        current = await self.actuator.current_placement(job)
        if current is None or len(current.nodes) >= original:
            self._grow_noted.pop(job, None)
            return
        plan = await self._plan(job, current, grow_back=True)
        if plan.placement is None or plan.kind != "grow" or plan.replaced or plan.dropped:
            self._grow_noted.pop(job, None)
            return  # not enough healthy spares (yet) for a larger data-parallel size
        refused = self._restarts.refuse(job, now, self.policy.guards)
        if refused is None and not self.policy.dry_run:
            self._grow_noted.pop(job, None)
            self._launch_grow(job, now, plan)
            return
        key = ",".join(plan.placement.nodes)
        if self._grow_noted.get(job) == key:
            return  # already recorded: one row per refused (or dry-run) grow-back
        self._grow_noted[job] = key
        if refused is None:
            self._launch_grow(job, now, plan)  # dry run: its steps record what they would do
            return
        rem = self._grow_remediation(job, now)
        params = {"plan": plan.kind, "reason": plan.reason, "from_nodes": list(current.nodes)}
        await self._record(None, rem, "restart_job", job, params, "skipped", refused)

    def _grow_remediation(self, job: str, now: float) -> Remediation:
        return Remediation(
            id=uuid.uuid4().hex[:12],
            incident_id=None,
            incident_kind="capacity_returned",
            job=job,
            node=None,
            steps=[str(Step.CHECKPOINT), str(Step.RESTART)],
            started_unix_s=now,
            dry_run=self.policy.dry_run,
            trigger=f"grow:{job}",
            grow=True,
        )

    def _launch_grow(self, job: str, now: float, plan: RestartPlan) -> None:
        """Checkpoint, then restart on the larger placement (planned again at the restart)."""
        rem = self._grow_remediation(job, now)
        rem.outcome = plan.reason
        log.info("growing a job back", extra={"fields": {"job": job, "plan": plan.reason}})
        book = self.book(job)
        book.ledger.fault(now, rem.ledger_id, "grow")
        book.ledger.detected(now, rem.ledger_id)
        self._start(rem, self._run(rem, None, None, [Step.CHECKPOINT, Step.RESTART]))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ views

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
        }
