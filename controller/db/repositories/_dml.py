"""The two bulk statements every repository builds on: upsert by primary key and append.

Private to the repositories: a module outside ``controller.db.repositories`` that writes a
table is a second write path, and ``tests/controller/test_ctl_persistence.py`` fails on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import JSON, Connection, Table
from sqlalchemy.dialects import postgresql, sqlite


def bulk_insert(conn: Connection, target: Table, rows: list[dict[str, Any]]) -> None:
    """Append rows as cheaply as the driver allows: ``COPY`` on PostgreSQL, the driver's own
    ``executemany`` with tuples on SQLite. Measured on 1,360 history rows (170 reports):
    PostgreSQL 43 -> 24 ms, SQLite 14 -> 6 ms against SQLAlchemy's ``executemany``. Tables
    with JSON columns take SQLAlchemy's path (it serializes them).
    """
    if not rows:
        return
    if any(isinstance(c.type, JSON) for c in target.columns):
        conn.execute(target.insert(), rows)
        return
    names = list(rows[0])
    tuples = [tuple(row[name] for name in names) for row in rows]
    driver = conn.connection.driver_connection
    columns = ", ".join(f'"{name}"' for name in names)
    if conn.dialect.name == "postgresql":
        statement = f'COPY "{target.name}" ({columns}) FROM STDIN'
        with driver.cursor() as cursor, cursor.copy(statement) as copy:  # type: ignore[union-attr]
            for values in tuples:
                copy.write_row(values)
        return
    marks = ", ".join("?" for _ in names)
    cursor = driver.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(f'INSERT INTO "{target.name}" ({columns}) VALUES ({marks})', tuples)
    finally:
        cursor.close()


def upsert(
    conn: Connection,
    target: Table,
    rows: Iterable[dict[str, Any]],
    *,
    keep: frozenset[str] = frozenset(),
) -> None:
    """Insert-or-replace full rows, keyed by the primary key, in one executemany.

    Columns in ``keep`` are written when the row is new and left alone when it exists: they
    have their own write path (a node's isolation), which a row built from memory a moment
    earlier must not undo.
    """
    batch = list(rows)
    if not batch:
        return
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(target)
    keys = [c.name for c in target.primary_key.columns]
    stmt = stmt.on_conflict_do_update(
        index_elements=keys,
        set_={
            c.name: stmt.excluded[c.name]
            for c in target.columns
            if c.name not in keys and c.name not in keep
        },
    )
    conn.execute(stmt, batch)
