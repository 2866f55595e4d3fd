"""What a database failure means for the client: bad data (4xx) or try again later (503).

The database is the last judge of what can be stored (a PostgreSQL ``text`` refuses NUL
bytes, a ``varchar(64)`` refuses a longer string, a constraint refuses a row). A value it
refuses will be refused again on every retry, so it is the client's error, never "retry
later" (an agent would retry it forever); a database that is unreachable, locked or
restarting is temporary, and the client is told when to come back.

::

    DataError (value out of range, NUL byte, too long, bad encoding)  -> InvalidInput  422
    SQLSTATE class 54, program limit exceeded (a row, an index entry
      or a statement too big or too complex for the server)           -> InvalidInput  422
    IntegrityError (constraint: check, unique, foreign key, not null) -> Conflict      409
    OperationalError, InterfaceError, pool timeout, disconnect,
      statement timeout or cancel (57014), lock timeout (55P03)       -> StoreUnavailable 503
    anything else (ProgrammingError: a bug or a missing migration)    -> unchanged     500
"""

from __future__ import annotations

from sqlalchemy import exc as sa

from controller.errors import Conflict, ControllerError, InvalidInput, StoreUnavailable

#: Seconds a client waits before retrying a write the database could not take.
RETRY_AFTER_S = 1.0


def _first_line(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    text = str(inner).strip().splitlines()
    return (text[0] if text else type(inner).__name__)[:200]


def _dbapi_kind(exc: BaseException) -> str:
    """The PEP 249 class of ``exc`` (``DataError``, ``IntegrityError``, ...), or ``""``.

    SQLAlchemy's wrappers and the drivers' own exceptions (raised where we talk to the
    driver directly: ``COPY`` on PostgreSQL, ``executemany`` on SQLite) share these names.
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    for kind in ("DataError", "IntegrityError", "OperationalError", "InterfaceError"):
        if kind in names:
            return kind
    return ""


#: SQLSTATE classes that end or refuse the session whatever was sent: connection exception
#: (``08``), operator intervention (``57``: shutdown, crash, "cannot connect now") but not
#: ``57014``, a statement cancelled or timed out, which depends on the statement.
_SESSION_SQLSTATE_CLASSES = ("08", "57")


#: SQLSTATE class of a statement the server cannot run within its limits (``54000`` a row
#: or index entry too big, ``54001`` statement too complex, ``54011`` too many columns,
#: ``54023`` too many arguments): psycopg raises it as an ``OperationalError``, but the same
#: statement fails the same way on every retry.
_PROGRAM_LIMIT_CLASS = "54"
#: A statement cancelled (``57014``: our ``statement_timeout``, or an operator's
#: ``pg_cancel_backend``) or a lock not granted in time (``55P03``).
_TIMED_OUT_SQLSTATES = frozenset({"57014", "55P03"})


def _sqlstate(exc: BaseException) -> str:
    """PostgreSQL's SQLSTATE behind ``exc`` (``""`` for SQLite or none)."""
    cause = _database_cause(exc)
    inner = getattr(cause, "orig", None) or cause
    state = getattr(inner, "sqlstate", None)
    return state if isinstance(state, str) else ""


def database_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` says a statement was cancelled for running too long (or waiting too
    long for a lock), rather than refused for what it carried.

    Why: the group commit retries each report of a failed batch alone to find the one the
    database refuses; after a timeout that finds nobody and costs one more timeout (30 s by
    default) per report, in a row, while the database is hung.
    """
    return _sqlstate(exc) in _TIMED_OUT_SQLSTATES


def database_away(exc: BaseException) -> bool:
    """Whether ``exc`` (a store error, or its cause) says the database could not be reached,
    the connection was lost (:func:`database_unreachable`, or a session ended under a
    statement) or a statement timed out (:func:`database_timed_out`: a hung server), rather
    than that it refused a statement.

    Why the timeout too: this decides what is logged once per outage (by the store) rather
    than once per refused request, and a hung server fails every report of each batch."""
    cause = _database_cause(exc)
    if isinstance(cause, sa.DBAPIError) and cause.connection_invalidated:
        return True
    return database_unreachable(exc) or database_timed_out(exc)


def database_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says no connection could be had at all: refused, timed out, the
    server refusing sessions (shutting down, starting up), the pool exhausted, SQLite's lock
    held by another process. A connection lost under a statement is not (the next one may
    work: a pooled connection the server or a PgBouncer restart dropped).

    Why: the group commit retries each report of a failed batch alone, to find the one a
    constraint refuses; with the database unreachable that is one more connection attempt
    (and connect timeout) per report, in a row, before any of them is answered.
    """
    cause = _database_cause(exc)
    if cause is None:
        return False
    if isinstance(cause, sa.TimeoutError | sa.DisconnectionError):
        return True
    if isinstance(cause, sa.DBAPIError) and cause.connection_invalidated:
        return False
    inner = getattr(cause, "orig", None) or cause
    if _dbapi_kind(inner) not in ("OperationalError", "InterfaceError"):
        return False
    if type(inner).__module__.startswith("psycopg"):
        state = getattr(inner, "sqlstate", None)
        return state is None or (state[:2] in _SESSION_SQLSTATE_CLASSES and state != "57014")
    return str(getattr(inner, "sqlite_errorname", "")).startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))


def _database_cause(exc: BaseException) -> BaseException | None:
    """The database's own error behind ``exc`` (ours are raised from it)."""
    cause: BaseException | None = exc
    while isinstance(cause, ControllerError):
        cause = cause.__cause__
    return cause


def database_error(exc: BaseException) -> ControllerError | None:
    """The client-facing error for a failed database call, or ``None`` if it is a bug."""
    if isinstance(exc, ControllerError):
        return exc
    kind = _dbapi_kind(exc)
    refused_value = kind == "DataError" or isinstance(exc, UnicodeError)
    if isinstance(exc, sa.StatementError) and isinstance(exc.orig, UnicodeError | ValueError):
        refused_value = True
    if refused_value:
        return InvalidInput(f"the database refused a value: {_first_line(exc)}")
    if _sqlstate(exc).startswith(_PROGRAM_LIMIT_CLASS):
        return InvalidInput(
            f"the database cannot store this, it exceeds a server limit ({_first_line(exc)}); "
            "sending it again will fail again"
        )
    if kind == "IntegrityError":
        return Conflict(f"the database refused the change: {_first_line(exc)}")
    if kind in ("OperationalError", "InterfaceError") or isinstance(
        exc, sa.TimeoutError | sa.DisconnectionError
    ):
        return StoreUnavailable(
            f"database unavailable ({_first_line(exc)}); nothing was changed, retry later",
            retry_after_s=RETRY_AFTER_S,
        )
    return None
