"""Rebuild the in-memory state from the database when the controller starts.

Each row becomes its dataclass by column name (``controller.db.repositories._rows``), so a
new column that the dataclass also has is loaded without a line here.

Jobs are read back only while they are retained (``job_retention_s``,
``controller.services.job_retention``): a job quiet for longer would be forgotten at the
first sweep anyway, so reading every job ever stored made each election cost, in time and
memory, as much as the whole job history. A job something still needs (an open incident,
a restart awaiting its first step, a remediation step left pending) is read back however
quiet, as the sweep keeps it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import Action, Job, Rank
from controller.db.repositories import commands, incidents, jobs, nodes
from controller.logic.detection.evidence_kinds import parse_evidence
from controller.logic.remediation.preflight import PREFLIGHT_KIND
from controller.services.remediation import history
from controller.state import (
    ClusterState,
    CommandState,
    Cursor,
    GpuState,
    IncidentState,
    JobState,
    NodeState,
    RankState,
)

#: Names per ``IN (…)`` query.
BATCH = 500


def load_state(session: Session, state: ClusterState, *, retention_s: float | None = None) -> None:
    """Fill ``state`` from the database. ``retention_s``: read back only jobs heard from
    within it, and those held (see the module docstring); ``None``: every job."""
    now = time.time()
    for n in nodes.load_nodes(session):
        state.nodes[n.name] = NodeState(
            **nodes.NODE.fields(n, NodeState),
            # Silence is counted from our own start: the controller being down is not the
            # agents' fault, and their spools are about to resend.
            last_seen_unix_s=now if n.health != "lost" else (n.last_report_unix_s or 0.0),
        )
    for g in nodes.load_gpus(session):
        node = state.nodes.get(g.node_name)
        if node is not None:
            node.gpus[g.index] = GpuState(**nodes.GPU.fields(g, GpuState))
    for c in nodes.load_cursors(session):
        state.cursors[(c.node_name, c.agent_instance)] = Cursor(committed_seq=c.last_seq)
    for i in incidents.load_open(session):
        found = incidents.INCIDENT.fields(i, IncidentState)
        # Typed once, here (an untyped kind or an odd row is kept as stored, never dropped).
        found["evidence"] = parse_evidence(i.kind, i.evidence)
        state.add_incident(IncidentState(**found))
    if retention_s is None:
        _load_jobs(state, jobs.load_jobs(session), jobs.load_ranks(session))
    else:
        _load_retained(session, state, now - retention_s)
    for cmd in commands.load_unfinished(session):
        state.commands[cmd.id] = CommandState(**commands.COMMAND.fields(cmd, CommandState))
    # The last preflight verdict of each node (placement and quarantine read them from the
    # commands in memory; finished ones leave memory, their rows stay).
    for cmd in commands.load_last_finished(session, PREFLIGHT_KIND):
        state.commands[cmd.id] = CommandState(**commands.COMMAND.fields(cmd, CommandState))


def _load_jobs(state: ClusterState, job_rows: Iterable[Job], rank_rows: Iterable[Rank]) -> None:
    for j in job_rows:
        state.jobs[j.name] = JobState(**jobs.JOB.fields(j, JobState))
    for r in rank_rows:
        job = state.jobs.get(r.job_name)
        if job is not None:
            job.ranks[r.rank] = RankState(**jobs.RANK.fields(r, RankState))


def _load_retained(session: Session, state: ClusterState, since_unix_s: float) -> None:
    """The jobs heard from after ``since_unix_s`` (as the retention sweep keeps them: it
    forgets a job at ``retention_s`` of quiet), then the held ones that are older."""
    recent = Job.last_seen_unix_s > since_unix_s
    _load_jobs(
        state,
        session.execute(select(Job).where(recent)).scalars(),
        session.execute(select(Rank).join(Job, Job.name == Rank.job_name).where(recent)).scalars(),
    )
    held = sorted(held_jobs(session, state) - state.jobs.keys())
    for start in range(0, len(held), BATCH):
        names = held[start : start + BATCH]
        _load_jobs(
            state,
            session.execute(select(Job).where(Job.name.in_(names))).scalars(),
            session.execute(select(Rank).where(Rank.job_name.in_(names))).scalars(),
        )


def held_jobs(session: Session, state: ClusterState) -> set[str]:
    """Jobs a new leader must have in memory however quiet: those its open incidents name
    (in ``state`` already), those whose newest restart had not resumed or was cut short
    (``pending``: its leader went away inside it; the engine restores the wait for the
    first step), and those a step left ``pending`` by an open incident's remediation names
    (the engine runs the rest of that rule). A superset of what the engine holds: what it
    does not need is forgotten at its first sweep."""
    held = {i.job for i in state.incidents.values() if i.job is not None}
    newest: set[str] = set()
    for row in reversed(history.restarts(session)):  # newest first
        if row.job in newest:
            continue  # an older restart of a job whose newest one was looked at
        newest.add(row.job)
        if row.status == "pending" or history.awaiting_resume(row):
            held.add(row.job)
    triggers = [f"incident:{i}" for i in sorted(state.incidents)]
    for start in range(0, len(triggers), BATCH):
        query = select(Action.params).where(
            Action.trigger.in_(triggers[start : start + BATCH]), Action.status == "pending"
        )
        for (params,) in session.execute(query):
            job = (params or {}).get("job")
            if isinstance(job, str):
                held.add(job)
    return held
