"""Commands for node agents: the one write path of ``commands``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, select
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


def load_last_finished(session: Session, kind: str) -> Sequence[Command]:
    """Each node's newest finished command of ``kind`` with a verdict (succeeded or
    failed): a new leader rebuilds the nodes' last preflight verdicts from them, so a node
    that failed its preflight stays out of placement across a restart or failover."""
    done = ("succeeded", "failed")
    newest = (
        select(Command.node_name, func.max(Command.finished_unix_s).label("at"))
        .where(Command.kind == kind, Command.status.in_(done))
        .group_by(Command.node_name)
        .subquery()
    )
    query = (
        select(Command)
        .join(
            newest,
            (Command.node_name == newest.c.node_name) & (Command.finished_unix_s == newest.c.at),
        )
        .where(Command.kind == kind, Command.status.in_(done))
        .order_by(Command.node_name, Command.id)
    )
    return session.execute(query).scalars().all()
