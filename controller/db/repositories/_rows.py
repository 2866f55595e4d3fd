"""Rows from domain objects and back, by column name, so a new column is one model line.

A column reads the attribute of the same name on the domain object, or the one a
repository's ``aliases`` names (``node_name`` <- ``node``); columns the object does not hold
(its parent's key, a computed value) are given by the caller. Loading is the inverse: every
column whose attribute is an ``__init__`` field of the dataclass is passed to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cache
from typing import Any

from sqlalchemy import Table

from controller.db.models import Base


@cache
def _columns(table: Table) -> tuple[str, ...]:
    return tuple(c.key for c in table.columns)


def row_of(
    model: type[Base],
    obj: object,
    *,
    aliases: Mapping[str, str] | None = None,
    given: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full row of ``model`` for ``obj``: ``given`` first, the rest read from ``obj``."""
    names = aliases or {}
    row = dict(given or {})
    for column in _columns(model.__table__):
        if column not in row:
            row[column] = getattr(obj, names.get(column, column))
    return row


def fields_of(
    model: type[Base],
    stored: object,
    target: type[Any],
    *,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``target(...)`` from the stored ``model`` row ``stored``."""
    names = aliases or {}
    wanted = {f.name for f in dataclasses.fields(target) if f.init}
    out: dict[str, Any] = {}
    for column in _columns(model.__table__):
        attr = names.get(column, column)
        if attr in wanted:
            value = getattr(stored, column)
            out[attr] = (
                dict(value)
                if isinstance(value, dict)
                else (list(value) if isinstance(value, list) else value)
            )
    return out
