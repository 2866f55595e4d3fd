"""Reading what the database holds, bypassing the controller: the write-path tests compare
it with what the API serves (memory and database must agree)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from controller.db.session import make_engine


def stored_rows(db_url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Every row ``sql`` selects, on a connection of its own."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def stored(db_url: str, sql: str, **params: Any) -> Any:
    """The one value ``sql`` selects (None when no row)."""
    rows = stored_rows(db_url, sql, **params)
    return rows[0][0] if rows else None


def stored_column(db_url: str, sql: str, **params: Any) -> list[Any]:
    """The first column of every row ``sql`` selects."""
    return [row[0] for row in stored_rows(db_url, sql, **params)]
