"""Database access off the event loop.

Every write runs on one dedicated thread, so writes are serialized in the process (SQLite
has a single writer anyway, and PostgreSQL sees no lock ping-pong between our own
transactions); reads run on the default thread pool. Handlers and detectors ``await`` these
calls and never block the loop on I/O.

A failed call raises the client-facing error (:mod:`controller.db.errors`: 422/409 for a
value or row the database refuses, 503 when it is unavailable), with the driver's error as
its cause, after the transaction was rolled back: nothing of it was stored.

An outage (the database could not be reached at all:
:func:`~controller.db.errors.database_away`) is logged here, twice: when the first call
finds the database away, and when the first call after it succeeds (how long, how many calls
failed). The callers that see its :class:`~controller.errors.StoreUnavailable` (every
agent's report, every periodic task's tick) do not log it again: during an outage they fail
hundreds of times a second.

On PostgreSQL every transaction here begins with ``SET LOCAL statement_timeout`` (not a
connection option: a transaction-pooling PgBouncer refuses startup options and mixes
sessions), so a statement the server never finishes (a COMMIT waiting for a lost synchronous
replica, a write waiting for another session's lock) is cancelled and answered 503 instead
of holding the one writer thread, and the group commit with it, for ever.
:attr:`Store.write_in_flight_s` says how long the current write has run (``/readyz``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.orm import Session

from controller.db.errors import database_away, database_error
from controller.errors import ControllerError, StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds any one statement of a store transaction may run on PostgreSQL (the setting
#: ``database_statement_timeout_s`` chooses; 0: no limit).
PG_STATEMENT_TIMEOUT_S = 30.0


class Store:
    def __init__(
        self, engine: Engine, *, statement_timeout_s: float = PG_STATEMENT_TIMEOUT_S
    ) -> None:
        self.engine = engine
        self.kind = engine.dialect.name
        ms = round(statement_timeout_s * 1000)
        #: Run first in each transaction (PostgreSQL with a limit only; SQLite has its
        #: busy timeout). ``SET LOCAL`` ends with the transaction, COMMIT included.
        self._set_timeout = (
            text(f"SET LOCAL statement_timeout = {ms}")
            if self.kind == "postgresql" and ms > 0
            else None
        )
        #: Monotonic time the transaction now on the writer thread began (None: idle).
        self._write_since: float | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tg-db-write")
        #: Transactions committed through this engine; the group-commit test and the
        #: ``trainguard_db_commits_total`` metric read it.
        self.commits = 0
        event.listen(engine, "commit", self._on_commit)
        #: Monotonic time the current outage began (None: the database answers).
        self.unavailable_since: float | None = None
        #: Calls that failed with the database unavailable during the current outage.
        self.unavailable_calls = 0
        self._outage_lock = threading.Lock()

    def _on_commit(self, _conn: Connection) -> None:
        self.commits += 1

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction on the writer thread; committed when this returns."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self._in_transaction, fn)

    async def read(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` with a read-only session on a worker thread."""
        return await asyncio.to_thread(self._read, fn)

    @property
    def write_in_flight_s(self) -> float:
        """Seconds the write now running on the writer thread has taken (0: none runs)."""
        since = self._write_since
        return 0.0 if since is None else time.monotonic() - since

    def _in_transaction(self, fn: Callable[[Connection], T]) -> T:
        def run() -> T:
            with self.engine.begin() as conn:
                if self._set_timeout is not None:
                    conn.execute(self._set_timeout)
                return fn(conn)

        self._write_since = time.monotonic()
        try:
            return self._guarded(run)
        finally:
            self._write_since = None

    def _read(self, fn: Callable[[Session], T]) -> T:
        def run() -> T:
            with Session(self.engine) as session:
                if self._set_timeout is not None:
                    session.execute(self._set_timeout)
                return fn(session)

        return self._guarded(run)

    def _guarded(self, run: Callable[[], T]) -> T:
        """``run()``, its failure raised as the client-facing error, and the database's
        outage noted (its start on a failure, its end on the next answer)."""
        try:
            result = run()
        except Exception as exc:
            mapped = self._failed(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        self._answered()
        return result

    def _failed(self, exc: Exception) -> Exception:
        """The error to raise for ``exc`` (mapped when it is the database's), noting an
        outage when it says the database is unavailable."""
        mapped: ControllerError | None = database_error(exc)
        if isinstance(mapped, StoreUnavailable) and database_away(exc):
            with self._outage_lock:
                self.unavailable_calls += 1
                began = self.unavailable_since is None
                if began:
                    self.unavailable_since = time.monotonic()
            if began:
                log.error(
                    "database unavailable: writes and reads fail (503) until it answers again",
                    extra={"fields": {"error": mapped.message}},
                )
        return exc if mapped is None else mapped

    def _answered(self) -> None:
        if self.unavailable_since is None:  # the usual case: no lock taken
            return
        with self._outage_lock:
            since, self.unavailable_since = self.unavailable_since, None
            failed, self.unavailable_calls = self.unavailable_calls, 0
        if since is not None:
            log.warning(
                "database available again",
                extra={
                    "fields": {
                        "unavailable_s": round(time.monotonic() - since, 1),
                        "failed_calls": failed,
                    }
                },
            )

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.engine.dispose()
