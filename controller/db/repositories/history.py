"""Per-report GPU summaries: the one write path of ``gpu_history`` (append, prune)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, select

from controller.db.models import GpuHistory
from controller.db.repositories._dml import bulk_insert


def append_history(conn: Connection, rows: list[dict[str, Any]]) -> None:
    bulk_insert(conn, GpuHistory.__table__, rows)  # type: ignore[arg-type]


def prune_history(conn: Connection, before_unix_s: float, *, limit: int) -> int:
    """Delete at most ``limit`` rows that ended before ``before_unix_s``, oldest first;
    return how many went (fewer than ``limit``: none older is left).

    Bounded because the caller runs it on the store's one writer thread, the group commit's:
    one unbounded DELETE over a backlog (retention lowered from a week to a day on a big
    fleet) outran the statement timeout, was cancelled, and came back a minute later to do
    it again, never finishing and holding every agent's report for the whole timeout each
    time. By primary key through the ``end_unix_s`` index, which both databases allow.
    """
    oldest = (
        select(GpuHistory.id)
        .where(GpuHistory.end_unix_s < before_unix_s)
        .order_by(GpuHistory.end_unix_s)
        .limit(limit)
    )
    result = conn.execute(delete(GpuHistory).where(GpuHistory.id.in_(oldest)))
    return int(result.rowcount)
