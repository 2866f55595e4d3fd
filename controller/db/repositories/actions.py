"""Actions the control loops took: the one write path of ``actions``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, update

from controller.db.models import Action


def insert_action(conn: Connection, row: dict[str, Any]) -> int:
    return int(conn.execute(insert(Action).returning(Action.id), row).scalar_one())


def update_action(conn: Connection, action_id: int, values: dict[str, Any]) -> None:
    conn.execute(update(Action).where(Action.id == action_id).values(**values))
