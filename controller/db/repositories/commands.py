"""Commands for node agents: the one write path of ``commands``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from controller.db.models import Command
from controller.db.repositories._dml import upsert
from controller.db.repositories._rows import RowMapper

COMMAND = RowMapper(Command, aliases={"node_name": "node"})
UNFINISHED = ("pending", "sent")


def command_row(command: object) -> dict[str, Any]:
    return COMMAND.row(command)


def upsert_commands(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, Command.__table__, rows)  # type: ignore[arg-type]


def load_unfinished(session: Session) -> Sequence[Command]:
    return session.execute(select(Command).where(Command.status.in_(UNFINISHED))).scalars().all()
