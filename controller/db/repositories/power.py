"""The power-domain tree: the one write path of ``power_domains``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, insert, select
from sqlalchemy.orm import Session

from controller.db.models import PowerDomain


def replace_domains(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Swap every stored domain for ``rows`` (parents first) in the caller's transaction."""
    conn.execute(delete(PowerDomain))
    if rows:
        conn.execute(insert(PowerDomain), rows)


def load_domains(session: Session) -> Sequence[PowerDomain]:
    return session.execute(select(PowerDomain)).scalars().all()
