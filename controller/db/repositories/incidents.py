"""Incidents: the one write path of ``incidents`` (open, bump, resolve)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.orm import Session

from controller.db.models import Incident
from controller.db.repositories._rows import RowMapper

#: A new incident's row leaves ``id`` out: it is the database's to give; ``evidence`` is
#: given as its stored JSON (memory holds it typed).
INCIDENT = RowMapper(
    Incident, aliases={"node_name": "node", "job_name": "job"}, exclude=("id", "evidence")
)


def incident_row(incident: object, evidence: dict[str, Any]) -> dict[str, Any]:
    """The row of a new ``incident`` whose evidence stores as ``evidence``."""
    return {**INCIDENT.row(incident), "evidence": evidence}


def insert_incident(conn: Connection, row: dict[str, Any]) -> int:
    return int(conn.execute(insert(Incident).returning(Incident.id), row).scalar_one())


def update_incident(conn: Connection, incident_id: int, values: dict[str, Any]) -> None:
    conn.execute(update(Incident).where(Incident.id == incident_id).values(**values))


def load_open(session: Session) -> Sequence[Incident]:
    return session.execute(select(Incident).where(Incident.state == "open")).scalars().all()
