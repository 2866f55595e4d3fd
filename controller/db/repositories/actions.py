"""Actions the control loops took: the one write path of ``actions``, and the power loop's
read-back of its own caps after a restart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.orm import Session

from controller.db.models import Action

#: The power policy's action kinds (``controller.services.power.tracking.action_kind``).
POWER_KINDS = ("power_cap", "power_uncap")
#: Statuses of an action whose command never reached an agent, or was refused by it: it
#: changed nothing on the GPU, so what holds is the action before it.
NOT_APPLIED = ("failed", "skipped", "dry_run")


class PowerActionRow(NamedTuple):
    """The newest power action of one (target, knob) that may have changed the GPU."""

    id: int
    kind: str
    target: str
    status: str
    params: Any
    """As stored: normally a dict, but an old or damaged row may hold anything."""


def insert_action(conn: Connection, row: dict[str, Any]) -> int:
    return int(conn.execute(insert(Action).returning(Action.id), row).scalar_one())


def update_action(conn: Connection, action_id: int, values: dict[str, Any]) -> None:
    conn.execute(update(Action).where(Action.id == action_id).values(**values))


def latest_power_actions(session: Session) -> Sequence[PowerActionRow]:
    """Per (target, ``params["knob"]``): the newest ``power_cap``/``power_uncap`` action not
    in :data:`NOT_APPLIED`, oldest first.

    One grouped query (SQLite's ``json_extract``, PostgreSQL's ``->>``), so a controller
    start reads one row per GPU and knob, not every power action ever taken. On SQLite a
    ``params`` that is not JSON text at all (a damaged row) is left out by ``json_valid``:
    extracting from it would fail the whole query (PostgreSQL's JSON column cannot hold one).
    Rows whose ``params`` has no string ``knob`` come back as one row per target (knob
    NULL) for the caller to skip."""
    knob = Action.params["knob"].as_string()
    newest = select(func.max(Action.id)).where(
        Action.kind.in_(POWER_KINDS), Action.status.notin_(NOT_APPLIED)
    )
    bind = session.get_bind()
    if bind.dialect.name == "sqlite":
        newest = newest.where(func.json_valid(Action.params) == 1)
    newest = newest.group_by(Action.target, knob)
    query = (
        select(Action.id, Action.kind, Action.target, Action.status, Action.params)
        .where(Action.id.in_(newest.scalar_subquery()))
        .order_by(Action.id)
    )
    return [PowerActionRow(*row) for row in session.execute(query).all()]
