"""Jobs and their ranks: the one write path of ``jobs`` and ``ranks``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select
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
