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
#: Seconds to open a PostgreSQL connection unless the URL says (``?connect_timeout=N``).
#: psycopg's own default is 130 s: a server that accepts and never answers (hung, or a
#: black-holed network) held each report, readiness probe and read that long, under the
#: agent's 10-s report timeout, instead of answering 503 "retry later".
PG_CONNECT_TIMEOUT_S = 5
#: libpq's TCP keepalives and ``tcp_user_timeout`` (ms) for every PostgreSQL connection,
#: each unless the URL sets it (``?keepalives_idle=30``). Without them a connection whose
#: server or network vanished mid-query (a failover, a partition: no FIN, no RST) waits for
#: the kernel's retransmission limit, ~15 minutes, holding the group commit all along. With
#: them the kernel gives up after ~11 s of silence (5 s idle, then 3 unanswered probes 2 s
#: apart), or once sent data stays unacknowledged for 10 s; the call then fails with a lost
#: connection (503) and the pool reconnects. A server that is slow but alive answers
#: keepalives from its kernel, so a long query is never cut by them.
PG_KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


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
    # Defaults only: a parameter in the URL wins (connect_args would override the URL's).
    defaults = {"connect_timeout": PG_CONNECT_TIMEOUT_S, **PG_KEEPALIVES}
    connect_args = dict(kwargs.pop("connect_args", {}))
    for name, value in defaults.items():
        if name not in parsed.query:
            connect_args.setdefault(name, value)
    kwargs["connect_args"] = connect_args
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


def sqlite_file(url: str) -> str | None:
    """The file behind a SQLite URL (``None``: not SQLite, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return str(Path(parsed.database).expanduser())


#: SQLite's result codes (``SQLITE_READONLY*`` aside: the file or its folder, where the
#: ``-wal`` and ``-shm`` files live, is read-only) for a file that is not a SQLite database
#: at all, or a damaged one.
_NOT_A_DATABASE = frozenset({"SQLITE_NOTADB", "SQLITE_CORRUPT"})


def sqlite_file_problem(url: str, exc: BaseException) -> str | None:
    """One line naming the database file for a SQLite error that no retry can fix (a
    read-only, damaged or unopenable file, or a directory), or ``None``.

    Why: SQLAlchemy's message (a class name, the statement, a link) does not say which file
    or what to do, and a read-only file must stop the controller at start rather than
    answer every report 503 ("retry later") forever.
    """
    path = sqlite_file(url)
    inner = getattr(exc, "orig", None) or exc
    if path is None or not isinstance(inner, sqlite3.Error):
        return None
    code = getattr(inner, "sqlite_errorname", "")
    detail = str(inner).strip().splitlines()[0] if str(inner).strip() else code
    if code in _NOT_A_DATABASE:
        return f"database file {path} is not a SQLite database (or is damaged): {detail}"
    if code.startswith("SQLITE_CANTOPEN"):
        if Path(path).is_dir():
            return f"database path {path} is a directory: name a file (sqlite:///path/to/file.db)"
        return (
            f"database file {path} cannot be opened (SQLite: {detail}); check that it and "
            "its folder exist and that this user may read and write them"
        )
    if code.startswith("SQLITE_READONLY"):
        return (
            f"database file {path} is read-only for this user (SQLite: {detail}); make it and "
            "its folder (SQLite writes its -wal and -shm files there) writable, or use "
            "another --database-url"
        )
    return None


def probe_sqlite_write(engine: Engine) -> None:
    """Take SQLite's write lock and rewrite one header field with its own value, then roll
    back: nothing changes, but a file this process may not write raises here.

    Why: with the schema at head the controller writes nothing at start, so a read-only
    file would go unnoticed until the first report (and ``BEGIN IMMEDIATE`` alone succeeds
    on a read-only file in WAL mode). ``user_version`` is SQLite's spare header integer;
    nothing here uses it, and the rollback leaves it as it was anyway.
    """
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert isinstance(raw, sqlite3.Connection)
        if raw.in_transaction:
            raw.rollback()
        level = raw.isolation_level
        raw.isolation_level = None  # we issue BEGIN/ROLLBACK ourselves
        try:
            raw.execute("BEGIN IMMEDIATE")
            try:
                (value,) = raw.execute("PRAGMA user_version").fetchone()
                raw.execute(f"PRAGMA user_version = {int(value)}")
            finally:
                raw.execute("ROLLBACK")
        finally:
            raw.isolation_level = level
