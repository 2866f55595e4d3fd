"""Read side: build the public shapes from the in-memory state or the database.

Routers call these; nothing here speaks HTTP. Database reads are plain functions of a
``Connection`` so they run on a worker thread via ``Store.read``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.db.models import Action, Command, GpuHistory, Incident
from controller.db.repositories import jobs as job_rows
from controller.logic.detection.evidence_kinds import read_evidence
from controller.schemas import (
    ACTION_ADAPTER,
    INCIDENT_ADAPTER,
    ActionPublic,
    CommandPublic,
    GpuHistoryPoint,
    GpuPublic,
    IncidentPublic,
    JobDetail,
    JobPublic,
    NodeDetail,
    NodePublic,
    RankPublic,
    StatusPublic,
)
from controller.state import ClusterState, CommandState, JobState, NodeState, RankState

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------- nodes / jobs


def node_public(state: ClusterState, node: NodeState) -> NodePublic:
    return NodePublic(
        name=node.name,
        hostname=node.hostname,
        health=node.health,
        health_reason=node.health_reason,
        labels=node.labels,
        backend=node.backend,
        agent_version=node.agent_version,
        gpu_count=len(node.gpus),
        gpus_unhealthy=node.gpus_unhealthy,
        power_w=node.power_w,
        last_report_unix_s=node.last_report_unix_s,
        first_seen_unix_s=node.first_seen_unix_s,
        open_incidents=state.open_incidents_for_node(node.name),
        isolated_reason=node.isolated_reason,
        isolated_unix_s=node.isolated_unix_s,
    )


def list_nodes(state: ClusterState, health: str | None) -> list[NodePublic]:
    nodes = sorted(state.nodes.values(), key=lambda n: n.name)
    return [node_public(state, n) for n in nodes if health is None or n.health == health]


def node_detail(state: ClusterState, node: NodeState, history: list[GpuHistoryPoint]) -> NodeDetail:
    gpus = [
        GpuPublic(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            health=g.health,
            health_reason=g.health_reason,
            latest=g.latest,
        )
        for g in sorted(node.gpus.values(), key=lambda g: g.index)
    ]
    return NodeDetail(**node_public(state, node).model_dump(), gpus=gpus, history=history)


def gpu_history(session: Session, node: str, since_unix_s: float) -> list[GpuHistoryPoint]:
    rows = session.execute(
        select(GpuHistory)
        .where(GpuHistory.node_name == node, GpuHistory.end_unix_s >= since_unix_s)
        .order_by(GpuHistory.end_unix_s, GpuHistory.gpu_index)
    ).scalars()
    return [GpuHistoryPoint.model_validate(r) for r in rows]


def in_world(job: JobState) -> list[RankState]:
    """The job's ranks that belong to its current world size: after a shrink, ranks at or
    above the new size are the previous run's and no longer count or show."""
    size = job.world_size
    return [r for r in job.ranks.values() if not size or r.rank < size]


def job_state(job: JobState, *, active_within_s: float, now: float) -> tuple[str, int]:
    """(state, ranks_reporting): stopped when every rank exited, degraded when a rank
    failed or fewer ranks than the world size report, running otherwise."""
    ranks = in_world(job)
    reporting = sum(
        1 for r in ranks if r.state == "running" and now - r.last_seen_unix_s <= active_within_s
    )
    if not ranks:
        return "unknown", 0
    if all(r.state in ("exited", "failed") for r in ranks):
        return "stopped", reporting
    if any(r.state == "failed" for r in ranks) or reporting < max(job.world_size, 1):
        return "degraded", reporting
    return "running", reporting


def job_public(state: ClusterState, job: JobState, *, active_within_s: float) -> JobPublic:
    status, reporting = job_state(job, active_within_s=active_within_s, now=time.time())
    nodes = sorted({r.node for r in in_world(job)})
    return _public(state, job, status, reporting, nodes)


def _public(
    state: ClusterState,
    job: JobState,
    status: str,
    reporting: int,
    nodes: list[str],
    source: str = "live",
) -> JobPublic:
    return JobPublic(
        name=job.name,
        state=status,
        source=source,
        world_size=job.world_size,
        ranks_reporting=reporting,
        nodes=nodes,
        last_step=job.last_step,
        first_seen_unix_s=job.first_seen_unix_s,
        last_seen_unix_s=job.last_seen_unix_s,
        open_incidents=state.open_incidents_for_job(job.name),
    )


def job_detail(state: ClusterState, job: JobState, *, active_within_s: float) -> JobDetail:
    return _detail(job, job_public(state, job, active_within_s=active_within_s))


def _detail(job: JobState, public: JobPublic) -> JobDetail:
    ranks = [_rank_public(r) for r in sorted(in_world(job), key=lambda r: r.rank)]
    return JobDetail(**public.model_dump(), ranks=ranks)


def _rank_public(r: RankState) -> RankPublic:
    return RankPublic(
        rank=r.rank,
        node=r.node,
        gpu_index=r.gpu_index,
        pid=r.pid,
        state=r.state,
        last_step=r.last_step,
        last_seen_unix_s=r.last_seen_unix_s,
    )


# Jobs that left memory (``job_retention_s``) keep their rows: read back on request. The
# reads run on a worker thread and hand back plain state objects; the public shapes are
# built on the event loop, which owns ``state``.


def stored_job(session: Session, name: str) -> JobState | None:
    """The job as the database last stored it, with its ranks (None: never stored)."""
    row = job_rows.load_job(session, name)
    if row is None:
        return None
    job = JobState(**job_rows.JOB.fields(row, JobState))
    for r in job_rows.load_ranks_of(session, name):
        job.ranks[r.rank] = RankState(**job_rows.RANK.fields(r, RankState))
    return job


def job_stored(session: Session, name: str) -> bool:
    """Whether the database holds job ``name`` (one row read, its ranks not loaded)."""
    return job_rows.load_job(session, name) is not None


#: How a route names a job that left memory (``job_retention_s``) but is stored.
ENDED = (
    "job {name!r} ended: not heard from for job_retention_s, it left the controller's "
    "memory (GET /api/v1/jobs/{name} shows it as stored)"
)


def stored_jobs_page(
    session: Session, *, limit: int, offset: int
) -> tuple[list[tuple[JobState, list[str]]], int]:
    """One page of every stored job by name, each with its nodes, and the total count."""
    rows, count = job_rows.page_jobs(session, limit=limit, offset=offset)
    nodes = job_rows.nodes_of(session, rows)
    page = [(JobState(**job_rows.JOB.fields(r, JobState)), nodes.get(r.name, [])) for r in rows]
    return page, count


def history_job_public(state: ClusterState, job: JobState, nodes: list[str]) -> JobPublic:
    """A stored job that is no longer in memory: ``ended``, nobody reporting, its rows as
    they were last written (a job that went silent may still show ranks ``running``)."""
    return _public(state, job, "ended", 0, nodes, source="history")


def history_job_detail(state: ClusterState, job: JobState) -> JobDetail:
    nodes = sorted({r.node for r in in_world(job)})
    return _detail(job, history_job_public(state, job, nodes))


def status(state: ClusterState, *, version: str, database: str) -> StatusPublic:
    gpus_total = sum(len(n.gpus) for n in state.nodes.values())
    gpus_unhealthy = sum(n.gpus_unhealthy for n in state.nodes.values())
    return StatusPublic(
        version=version,
        database=database,
        nodes_total=len(state.nodes),
        nodes_by_health=state.nodes_by_health(),
        gpus_total=gpus_total,
        gpus_unhealthy=gpus_unhealthy,
        jobs_total=len(state.jobs),
        incidents_open=len(state.incidents),
        incidents_open_by_kind=state.incidents_open_by_kind(),
        reports_total=state.reports_total,
        uptime_s=time.time() - state.started_unix_s,
    )


# ---------------------------------------------------------------------- database lists


def _page(session: Session, query: Any, limit: int, offset: int) -> tuple[list[Any], int]:
    count = session.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    rows = list(session.execute(query.limit(limit).offset(offset)).scalars())
    return rows, int(count)


def incident_public(row: Incident) -> IncidentPublic:
    """A stored incident, its evidence typed by its kind. A row whose evidence does not fit
    its kind's model (hand-edited, or a release that broke its shape) is still shown, with
    its evidence as stored and ``evidence_error`` saying why: an incident is never hidden."""
    fields: dict[str, object] = {
        "id": row.id,
        "kind": row.kind,
        "severity": row.severity,
        "state": row.state,
        "summary": row.summary,
        "node": row.node_name,
        "gpu_index": row.gpu_index,
        "job": row.job_name,
        "ranks": list(row.ranks),
        "evidence": dict(row.evidence),
        "count": row.count,
        "opened_unix_s": row.opened_unix_s,
        "updated_unix_s": row.updated_unix_s,
        "resolved_unix_s": row.resolved_unix_s,
    }
    typed, error = read_evidence(row.kind, row.evidence)
    if typed is not None:
        fields["evidence"] = typed  # validated once, here: the schema takes the model as is
    else:
        # Untyped: a kind without a model (no error), or a row that does not fit its own.
        fields["evidence_error"] = error
        if error is not None:
            log.warning(
                "incident %s (%s): evidence does not fit its kind's model: %s",
                row.id,
                row.kind,
                error,
            )
    return INCIDENT_ADAPTER.validate_python(fields)


def list_incidents(
    session: Session,
    *,
    state: str | None,
    kind: str | None,
    node: str | None,
    job: str | None,
    limit: int,
    offset: int,
) -> tuple[list[IncidentPublic], int]:
    query = select(Incident).order_by(Incident.opened_unix_s.desc(), Incident.id.desc())
    if state is not None:
        query = query.where(Incident.state == state)
    if kind is not None:
        query = query.where(Incident.kind == kind)
    if node is not None:
        query = query.where(Incident.node_name == node)
    if job is not None:
        query = query.where(Incident.job_name == job)
    rows, count = _page(session, query, limit, offset)
    return [incident_public(r) for r in rows], count


def get_incident(session: Session, incident_id: int) -> IncidentPublic | None:
    row = session.get(Incident, incident_id)
    return None if row is None else incident_public(row)


def list_actions(session: Session, *, limit: int, offset: int) -> tuple[list[ActionPublic], int]:
    query = select(Action).order_by(Action.created_unix_s.desc(), Action.id.desc())
    rows, count = _page(session, query, limit, offset)
    return [a for a in (_action_public(r) for r in rows) if a is not None], count


def _action_public(row: Action) -> ActionPublic | None:
    """A stored action row, its params typed by kind; a row whose params do not fit its
    kind's model (hand-edited, or a bug) is left out with a log line, not a 500 for the
    whole page."""
    try:
        return ACTION_ADAPTER.validate_python(row, from_attributes=True)
    except ValidationError as exc:
        log.warning(
            "action %s (%s) skipped: its params do not fit the model: %s",
            row.id,
            row.kind,
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
        )
        return None


def command_public(row: Command | CommandState) -> CommandPublic:
    """A command as the API shows it, from its row or its (fresher) in-memory state."""
    return CommandPublic(
        id=row.id,
        node=row.node_name if isinstance(row, Command) else row.node,
        kind=row.kind,
        params=dict(row.params),
        status=row.status,
        reason=row.reason,
        created_unix_s=row.created_unix_s,
        sent_unix_s=row.sent_unix_s,
        finished_unix_s=row.finished_unix_s,
    )


def list_commands(
    session: Session, *, node: str | None, status: str | None, limit: int, offset: int
) -> tuple[list[CommandPublic], int]:
    query = select(Command).order_by(Command.created_unix_s.desc(), Command.id)
    if node is not None:
        query = query.where(Command.node_name == node)
    if status is not None:
        query = query.where(Command.status == status)
    rows, count = _page(session, query, limit, offset)
    return [command_public(r) for r in rows], count
