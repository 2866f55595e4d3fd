"""Per-report GPU summaries: the one write path of ``gpu_history`` (append, prune)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete

from controller.db.models import GpuHistory
from controller.db.repositories._dml import bulk_insert


def append_history(conn: Connection, rows: list[dict[str, Any]]) -> None:
    bulk_insert(conn, GpuHistory.__table__, rows)  # type: ignore[arg-type]


def prune_history(conn: Connection, before_unix_s: float) -> None:
    conn.execute(delete(GpuHistory).where(GpuHistory.end_unix_s < before_unix_s))
