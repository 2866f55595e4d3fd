"""Checkpoint events the ranks reported: the one write path of ``checkpoints``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from controller.db.models import Checkpoint
from controller.db.repositories._dml import bulk_insert


def append_checkpoints(conn: Connection, rows: list[dict[str, Any]]) -> None:
    bulk_insert(conn, Checkpoint.__table__, rows)  # type: ignore[arg-type]
