"""Jobs and their ranks: the one write path of ``jobs`` and ``ranks``, and the reads of
the jobs that left memory (``job_retention_s``) that the API answers from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, or_, select
from sqlalchemy.orm import Session

from controller.db.models import Job, Rank
from controller.db.repositories._dml import upsert
from controller.db.repositories._rows import RowMapper

JOB = RowMapper(Job)
RANK = RowMapper(Rank, aliases={"node_name": "node"}, given=("job_name",))


def job_row(job: object) -> dict[str, Any]:
    return JOB.row(job)


def rank_row(job_name: str, rank: object) -> dict[str, Any]:
    return RANK.row(rank, job_name)


def upsert_jobs(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, Job.__table__, rows)  # type: ignore[arg-type]


def upsert_ranks(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, Rank.__table__, rows)  # type: ignore[arg-type]


def load_jobs(session: Session) -> Sequence[Job]:
    return session.execute(select(Job)).scalars().all()


def load_ranks(session: Session) -> Sequence[Rank]:
    return session.execute(select(Rank)).scalars().all()


# Reads of jobs that left memory (``job_retention_s``): the API's history view.


def load_job(session: Session, name: str) -> Job | None:
    return session.get(Job, name)


def load_ranks_of(session: Session, name: str) -> Sequence[Rank]:
    return session.execute(select(Rank).where(Rank.job_name == name)).scalars().all()


def page_jobs(session: Session, *, limit: int, offset: int) -> tuple[Sequence[Job], int]:
    """One page of every stored job, by name, and how many there are."""
    count = session.execute(select(func.count()).select_from(Job)).scalar_one()
    rows = session.execute(select(Job).order_by(Job.name).limit(limit).offset(offset))
    return rows.scalars().all(), int(count)


def nodes_of(session: Session, jobs: Sequence[Job]) -> dict[str, list[str]]:
    """Each job's nodes, from the ranks of its last world size (a shrunk job's higher ranks
    are the previous run's), without loading every rank of a 2,048-rank job."""
    if not jobs:
        return {}
    rows = session.execute(
        select(Rank.job_name, Rank.node_name)
        .join(Job, Job.name == Rank.job_name)
        .where(
            Rank.job_name.in_([j.name for j in jobs]),
            or_(Job.world_size == 0, Rank.rank < Job.world_size),
        )
        .distinct()
        .order_by(Rank.job_name, Rank.node_name)
    )
    nodes: dict[str, list[str]] = {}
    for job, node in rows:
        nodes.setdefault(job, []).append(node)
    return nodes
