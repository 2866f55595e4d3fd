"""What earlier leaders did, read back from the action rows when a leader starts acting.

The engine keeps its guard rails in memory for speed, but memory dies with a controller.
Everything a new leader (after a restart or a failover) must not forget is rebuilt here from
the durable action log, with bounded queries on indexed columns (``trigger``,
``created_unix_s``):

* :func:`incident_actions`: the rows of the open incidents (decided ones are never acted on
  twice; a ``pending`` row is a step its leader was inside when it went away);
* :func:`refused_companions`: open incidents a remediation batched with its own whose
  isolation the budget refused (their row is under that remediation's trigger, not theirs);
* :func:`restarts`: recent ``restart_job`` rows, which refill the per-job restart budget
  (so the rate limit survives a failover) and say each job's original size (for grow-back);
* :func:`interrupted_grows`: grow-back rows left ``pending``, closed by the new leader;
* :func:`policy_isolations`: the nodes remediation isolated within the isolation budgets'
  windows, released since or not (read at each isolation, so the circuit breaker and the
  quarantine budget count them after a restart or failover too);
* :func:`replay`: the goodput ledger's incidents, from the ``goodput`` parameters each
  ``restart_job`` row carries (fault, detection, steps reached and resumed from, and, once
  the job stepped again, when it resumed), and :func:`job_starts` for the wall clock;
* :func:`newest_restart` and :func:`remediation_started`: each job's newest restart, from
  which a new leader restores when the job was last remediated and restarted and, when the
  job had not stepped again yet, the wait for it to resume (its first step ends the wait,
  or ``guards.resume_timeout_s`` fails it, as if no leader had changed);
* :func:`newest_committed_before` and :func:`rollback_bound`: the checkpoint a ``rollback``
  resumes from, from the agents' checkpoint events (a new leader has no such memory),
  leaving out the steps retention reported ``deleted`` since their commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, exists, func, select
from sqlalchemy.orm import Session, aliased

from controller.db.models import Action, Checkpoint, Incident, Job
from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.params import GoodputFacts

#: Most restart rows read back; more restarts than this within one rate-limit window would
#: already have been refused.
RESTART_ROWS = 1000
#: Triggers per ``IN (…)`` query.
BATCH = 500


@dataclass(frozen=True, slots=True)
class IncidentAction:
    id: int
    incident_id: int
    kind: str
    status: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RestartRow:
    id: int
    job: str
    trigger: str
    status: str
    #: When the restart took effect (its row's end), or began when still ``pending``.
    at_unix_s: float
    params: dict[str, Any]
    #: When its row was written (just before the actuator was called).
    created_unix_s: float = 0.0


def incident_actions(session: Session, incident_ids: list[int]) -> list[IncidentAction]:
    """Every action row triggered by one of ``incident_ids``, oldest first."""
    triggers = [f"incident:{i}" for i in incident_ids]
    rows: list[IncidentAction] = []
    for start in range(0, len(triggers), BATCH):
        query = (
            select(Action.id, Action.trigger, Action.kind, Action.status, Action.params)
            .where(Action.trigger.in_(triggers[start : start + BATCH]))
            .order_by(Action.id)
        )
        for action_id, trigger, kind, status, params in session.execute(query):
            try:
                incident_id = int(str(trigger).split(":", 1)[1])
            except (IndexError, ValueError):
                continue
            rows.append(IncidentAction(action_id, incident_id, kind, status, params or {}))
    return sorted(rows, key=lambda r: r.id)


#: The parameter of a budget's refusal to isolate a companion node (``steps/batch.py``):
#: the ids of that node's incidents, decided with the refusal, not acted on again.
REFUSED_INCIDENTS = "refused_incidents"
#: Status of the rows :func:`refused_companions` returns: never a step left ``pending``.
BATCHED = "batched"


def refused_companions(session: Session, incident_ids: list[int]) -> list[IncidentAction]:
    """One row per open incident in ``incident_ids`` that a budget's refusal to isolate its
    node as a companion decided (status :data:`BATCHED`, the refusal's id, kind and
    parameters), oldest first.

    The refusal's row is under the first incident's trigger, which :func:`incident_actions`
    reads only while that incident is open, so it is looked for among the skipped
    isolations written since the oldest of ``incident_ids`` opened (none is older)."""
    wanted = set(incident_ids)
    oldest: float | None = None
    for start in range(0, len(incident_ids), BATCH):
        chunk = incident_ids[start : start + BATCH]
        found = session.execute(
            select(func.min(Incident.opened_unix_s)).where(Incident.id.in_(chunk))
        ).scalar()
        if found is not None:
            oldest = float(found) if oldest is None else min(oldest, float(found))
    if oldest is None:
        return []
    query = (
        select(Action.id, Action.kind, Action.params)
        .where(
            Action.created_unix_s >= oldest,
            Action.kind == "isolate_node",
            Action.status == "skipped",
            Action.trigger.like("incident:%"),
        )
        .order_by(Action.id.desc())
        .limit(ISOLATION_ROWS)
    )
    rows: list[IncidentAction] = []
    for action_id, kind, params in session.execute(query):
        named = params.get(REFUSED_INCIDENTS) if isinstance(params, dict) else None
        if not isinstance(named, list):
            continue
        for incident_id in named:
            if isinstance(incident_id, int) and incident_id in wanted:
                rows.append(IncidentAction(action_id, incident_id, kind, BATCHED, params))
    return sorted(rows, key=lambda r: r.id)


def restarts(session: Session) -> list[RestartRow]:
    """The newest ``restart_job`` rows that took (or may have taken) effect, oldest first.

    ``pending`` rows count: their leader went away inside the actuator call, which may have
    gone through; the rate limit errs on the side of fewer restarts.
    """
    query = (
        select(
            Action.id,
            Action.target,
            Action.trigger,
            Action.status,
            Action.created_unix_s,
            Action.finished_unix_s,
            Action.params,
        )
        .where(Action.kind == "restart_job", Action.status.in_(("succeeded", "pending")))
        .order_by(Action.id.desc())
        .limit(RESTART_ROWS)
    )
    rows = [
        RestartRow(r[0], r[1], r[2], r[3], r[5] if r[5] is not None else r[4], r[6] or {}, r[4])
        for r in session.execute(query)
    ]
    return rows[::-1]


def interrupted_grows(session: Session, since_unix_s: float) -> list[int]:
    """Ids of grow-back rows (trigger ``grow:<job>``) still ``pending`` since ``since_unix_s``."""
    query = (
        select(Action.id, Action.trigger)
        .where(Action.created_unix_s >= since_unix_s, Action.status == "pending")
        .order_by(Action.id)
    )
    return [r[0] for r in session.execute(query) if str(r[1]).startswith("grow:")]


#: Most isolation rows read back; more isolations than this within one window would already
#: have been refused by the circuit breaker on any fleet below this size.
ISOLATION_ROWS = 10_000
#: Statuses of an isolation that took (or may have taken) effect: ``failed`` too, since the
#: policy's step keeps a node the cluster refused isolated in trainguard's own record, and
#: ``pending`` (its leader went away inside the actuator call, which may have gone through).
ISOLATING = ("succeeded", "failed", "pending")


def policy_isolations(session: Session, since_unix_s: float) -> list[tuple[str, float]]:
    """(node, when) of every isolation remediation made since ``since_unix_s``, newest first.

    Remediation's rows only: trigger ``incident:<id>`` (an operator's by hand is
    ``operator:<name>`` and counts only while the node stays isolated), with the
    ``actuator`` parameter the isolation itself writes (a row saying the node was *already
    isolated*, by an operator perhaps, isolated nothing)."""
    query = (
        select(Action.target, Action.created_unix_s, Action.params)
        .where(
            Action.created_unix_s >= since_unix_s,
            Action.kind == "isolate_node",
            Action.trigger.like("incident:%"),
            Action.status.in_(ISOLATING),
        )
        .order_by(Action.id.desc())
        .limit(ISOLATION_ROWS)
    )
    return [
        (str(target), float(created))
        for target, created, params in session.execute(query)
        if isinstance(params, dict) and "actuator" in params
    ]


def job_starts(session: Session, jobs: list[str]) -> dict[str, float]:
    """When the controller first saw each of ``jobs`` (the goodput ledger's wall start)."""
    found: dict[str, float] = {}
    for start in range(0, len(jobs), BATCH):
        query = select(Job.name, Job.first_seen_unix_s).where(
            Job.name.in_(jobs[start : start + BATCH])
        )
        found |= {str(name): float(seen) for name, seen in session.execute(query)}
    return found


def replay(ledger: GoodputLedger, rows: list[RestartRow]) -> int:
    """Feed ``ledger`` the restarts of its job recorded in ``rows`` (oldest first).

    Returns how many were replayed. Incidents that ended without a restart (a straggler
    that went away) leave no ``restart_job`` row and are not rebuilt.
    """
    replayed = 0
    for row in rows:
        raw = row.params.get("goodput")
        if row.job != ledger.job or row.status != "succeeded" or not isinstance(raw, dict):
            continue
        try:  # a pydantic ValidationError is a ValueError too
            facts = GoodputFacts.model_validate(raw)
            ledger.fault(facts.fault_unix_s, facts.ledger_id, facts.kind)
            ledger.detected(facts.detected_unix_s, facts.ledger_id)
            restarted = facts.restart_unix_s
            ledger.restart_started(
                restarted if restarted is not None else row.at_unix_s,
                facts.ledger_id,
                facts.last_step,
                facts.resume_step,
                step_s=facts.step_s,
            )
            if facts.resumed_unix_s is not None:
                ledger.resumed(facts.resumed_unix_s)
        except (KeyError, TypeError, ValueError):
            continue  # a row written by another version: its cost is not rebuilt
        replayed += 1
    return replayed


def newest_restart(rows: list[RestartRow], job: str) -> RestartRow | None:
    """The newest ``succeeded`` restart of ``job`` in ``rows`` (oldest first), unless a newer
    one is still ``pending`` (its leader went away inside it: the remediation that row
    belongs to is another one, closed as interrupted by the new leader)."""
    for row in reversed(rows):
        if row.job != job:
            continue
        return row if row.status == "succeeded" else None
    return None


def awaiting_resume(row: RestartRow) -> bool:
    """Whether the job of restart ``row`` had not stepped again when its leader went away
    (no ``resumed_unix_s`` in its goodput facts, no recorded resume failure)."""
    raw = row.params.get("goodput")
    if "resume_failed" in row.params or not isinstance(raw, dict):
        return False
    return raw.get("resumed_unix_s") is None


def remediation_started(session: Session, row: RestartRow) -> float:
    """When the remediation of restart ``row`` began: its first row other than an alert
    (a rule's alert is raised at the incident's first match, before its window), or the
    restart row itself. Not before the incident was detected: grow-backs of one job share
    their trigger, and a grow-back's detection time is when it began."""
    raw = row.params.get("goodput")
    detected = raw.get("detected_unix_s") if isinstance(raw, dict) else None
    since = float(detected) if isinstance(detected, int | float) else row.created_unix_s
    query = select(func.min(Action.created_unix_s)).where(
        Action.trigger == row.trigger,
        Action.kind != "alert",
        Action.created_unix_s >= since,
        Action.created_unix_s <= row.created_unix_s,
    )
    found = session.execute(query).scalar()
    return float(found) if found is not None else row.created_unix_s


def outcome_of(session: Session, action_id: int) -> str:
    """The outcome an action row holds now (``""`` for a row that is not there)."""
    found = session.execute(select(Action.outcome).where(Action.id == action_id)).scalar()
    return str(found) if found is not None else ""


def still_there() -> ColumnElement[bool]:
    """A ``committed`` row's copy still exists: no ``deleted`` event of the same job, step
    and tier came after it. "After" is the row order (the id), not the ranks' clocks: a
    step deleted by one run and committed again by a later one (after a rollback, on
    other nodes) exists, and rank 0 reports a step's deletion after its commit. Ranks that
    never send ``deleted`` (older versions) leave every commit standing, as before."""
    gone = aliased(Checkpoint)
    return ~exists().where(
        gone.job_name == Checkpoint.job_name,
        gone.step == Checkpoint.step,
        gone.tier == Checkpoint.tier,
        gone.kind == "deleted",
        gone.id > Checkpoint.id,
    )


def _committed(job: str) -> tuple[ColumnElement[bool], ...]:
    return (Checkpoint.job_name == job, Checkpoint.kind == "committed")


def newest_committed_before(session: Session, job: str, step: int) -> int | None:
    """The newest checkpoint step of ``job`` committed (rank 0's ``committed`` event) below
    ``step`` and not deleted since, or None. Strictly below: the checkpoint labelled
    ``step`` holds the weights that the damaged step started from, which may already carry
    the cause (an overflowing update shows up as NaN only in the next step's gradients).

    A commit of either tier counts: ``committed`` means complete somewhere a restart loads
    from (the job's shared root, ``tier=local``; or, for node-local roots, the object
    store, ``tier=object_store``), and the restarted ranks take the nearest complete copy.
    An ``uploaded`` (one rank's files in the bucket) is not a commit. A commit that
    retention has ``deleted`` since (:func:`still_there`) no longer counts: resuming from
    it would fail on every rank."""
    query = select(func.max(Checkpoint.step)).where(
        *_committed(job), Checkpoint.step < step, still_there()
    )
    found = session.execute(query).scalar()
    return int(found) if found is not None else None


#: Deleted steps a refused rollback names (the newest ones below the bad step).
DELETED_NAMED = 5


@dataclass(frozen=True, slots=True)
class RollbackBound:
    """Where a rollback below ``bad`` could resume, and why it cannot when it cannot."""

    #: The newest committed step below the bad one that still exists, or None.
    clean: int | None
    #: Committed steps below the bad one that retention deleted since (newest
    #: :data:`DELETED_NAMED` at most, oldest first); only read when ``clean`` is None.
    deleted: list[int]
    #: The oldest committed step that still exists (at or above the bad one when ``clean``
    #: is None: it already holds the damage), or None.
    oldest_kept: int | None


def rollback_bound(session: Session, job: str, bad: int) -> RollbackBound:
    """:func:`newest_committed_before` ``bad``, and, when there is none, what retention
    deleted below it and the oldest step kept: a rollback refused because the job's own
    retention removed every clean checkpoint says so, instead of restarting the job into
    a resume that fails on every rank."""
    clean = newest_committed_before(session, job, bad)
    if clean is not None:
        return RollbackBound(clean=clean, deleted=[], oldest_kept=None)
    deleted_query = (
        select(Checkpoint.step)
        .where(*_committed(job), Checkpoint.step < bad)
        .distinct()
        .order_by(Checkpoint.step.desc())
        .limit(DELETED_NAMED)
    )
    deleted = sorted(int(s) for s in session.execute(deleted_query).scalars())
    kept_query = select(func.min(Checkpoint.step)).where(*_committed(job), still_there())
    kept = session.execute(kept_query).scalar()
    return RollbackBound(
        clean=None, deleted=deleted, oldest_kept=int(kept) if kept is not None else None
    )
