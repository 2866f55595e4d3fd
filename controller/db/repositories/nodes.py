"""Nodes, their GPUs and their agents' dedupe cursors: the one write path of ``nodes``,
``gpus`` and ``agent_cursors``.

Rows are upserted whole from the in-memory state (the group-commit writer), except a node's
isolation, which has its own statement (:func:`set_isolation`) so that remediation can write
it *before* showing it: an upsert built from memory never overwrites those two columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.orm import Session

from controller.db.models import AgentCursor, Gpu, Node
from controller.db.repositories._dml import upsert
from controller.db.repositories._rows import RowMapper

#: Written only by :func:`set_isolation`; a row upserted from memory keeps the stored values.
ISOLATION_COLUMNS = frozenset({"isolated_reason", "isolated_unix_s"})


NODE = RowMapper(Node)
GPU = RowMapper(Gpu, given=("node_name",))


def node_row(node: object) -> dict[str, Any]:
    return NODE.row(node)


def gpu_row(node_name: str, gpu: object) -> dict[str, Any]:
    return GPU.row(gpu, node_name)


def cursor_row(node_name: str, instance: str, last_seq: int, now_unix_s: float) -> dict[str, Any]:
    return {
        "node_name": node_name,
        "agent_instance": instance,
        "last_seq": last_seq,
        "updated_unix_s": now_unix_s,
    }


def upsert_nodes(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, Node.__table__, rows, keep=ISOLATION_COLUMNS)  # type: ignore[arg-type]


def upsert_gpus(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, Gpu.__table__, rows)  # type: ignore[arg-type]


def upsert_cursors(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, AgentCursor.__table__, rows)  # type: ignore[arg-type]


def set_isolation(conn: Connection, name: str, reason: str | None, at: float | None) -> bool:
    """Store (or clear, with ``None``) a node's isolation; ``False`` if no row has the name."""
    result = conn.execute(
        update(Node).where(Node.name == name).values(isolated_reason=reason, isolated_unix_s=at)
    )
    return result.rowcount == 1


def load_nodes(session: Session) -> Sequence[Node]:
    return session.execute(select(Node)).scalars().all()


def load_gpus(session: Session) -> Sequence[Gpu]:
    return session.execute(select(Gpu)).scalars().all()


def load_cursors(session: Session) -> Sequence[AgentCursor]:
    return session.execute(select(AgentCursor)).scalars().all()
