"""Typed keys of the rows that mirror the in-memory state.

A service that changed an entity in :class:`~controller.state.ClusterState` names it with one
of these keys; the group-commit writer turns the key into the entity's full row at flush
time (``ClusterState.row_for``) and hands it to the table's repository. The key's class says
which table, its fields are the primary key, so a misspelt table or a key of the wrong shape
is a type error, not a row that silently never gets written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import Table

from controller.db.models import AgentCursor, Command, Gpu, Job, Node, Rank


@dataclass(frozen=True, slots=True, order=True)
class NodeKey:
    table: ClassVar[Table] = Node.__table__  # type: ignore[assignment]
    name: str


@dataclass(frozen=True, slots=True, order=True)
class GpuKey:
    table: ClassVar[Table] = Gpu.__table__  # type: ignore[assignment]
    node: str
    index: int


@dataclass(frozen=True, slots=True, order=True)
class CursorKey:
    table: ClassVar[Table] = AgentCursor.__table__  # type: ignore[assignment]
    node: str
    instance: str


@dataclass(frozen=True, slots=True, order=True)
class JobKey:
    table: ClassVar[Table] = Job.__table__  # type: ignore[assignment]
    name: str


@dataclass(frozen=True, slots=True, order=True)
class RankKey:
    table: ClassVar[Table] = Rank.__table__  # type: ignore[assignment]
    job: str
    rank: int


@dataclass(frozen=True, slots=True, order=True)
class CommandKey:
    table: ClassVar[Table] = Command.__table__  # type: ignore[assignment]
    id: str


RowKey = NodeKey | GpuKey | CursorKey | JobKey | RankKey | CommandKey

__all__ = ["CommandKey", "CursorKey", "GpuKey", "JobKey", "NodeKey", "RankKey", "RowKey"]
