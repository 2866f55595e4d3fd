"""Engine creation: one place that knows SQLite's pragmas and PostgreSQL's pool settings.

SQLite runs in WAL mode so API reads never block the group-commit writer, with
``synchronous=NORMAL`` (durable across a process crash, which is what an acknowledged report
needs; an OS crash may lose the last commits, which the agents' spools resend) and a busy
timeout so the rare second writer (incidents, commands) waits instead of failing.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 10_000
#: Pages in the WAL before a commit checkpoints it itself. The controller checkpoints from
#: a background thread every second; this is only the safety net (40 MB).
SQLITE_WAL_AUTOCHECKPOINT_PAGES = 10_000


def database_kind(url: str) -> str:
    return make_url(url).get_backend_name()


def make_engine(url: str, **kwargs: Any) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            **kwargs,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_size", 8)
    kwargs.setdefault("max_overflow", 8)
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_AUTOCHECKPOINT_PAGES}")
    finally:
        cursor.close()
