"""Database access off the event loop.

Every write runs on one dedicated thread, so writes are serialized in the process (SQLite
has a single writer anyway, and PostgreSQL sees no lock ping-pong between our own
transactions); reads run on the default thread pool. Handlers and detectors ``await`` these
calls and never block the loop on I/O.

A failed call raises the client-facing error (:mod:`controller.db.errors`: 422/409 for a
value or row the database refuses, 503 when it is unavailable), with the driver's error as
its cause, after the transaction was rolled back: nothing of it was stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from controller.db.errors import database_error

T = TypeVar("T")


class Store:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kind = engine.dialect.name
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tg-db-write")
        #: Transactions committed through this engine; the group-commit test and the
        #: ``trainguard_db_commits_total`` metric read it.
        self.commits = 0
        event.listen(engine, "commit", self._on_commit)

    def _on_commit(self, _conn: Connection) -> None:
        self.commits += 1

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one transaction on the writer thread; committed when this returns."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self._in_transaction, fn)

    async def read(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` with a read-only session on a worker thread."""
        return await asyncio.to_thread(self._read, fn)

    def _in_transaction(self, fn: Callable[[Connection], T]) -> T:
        try:
            with self.engine.begin() as conn:
                return fn(conn)
        except Exception as exc:
            mapped = database_error(exc)
            if mapped is None or mapped is exc:
                raise
            raise mapped from exc

    def _read(self, fn: Callable[[Session], T]) -> T:
        try:
            with Session(self.engine) as session:
                return fn(session)
        except Exception as exc:
            mapped = database_error(exc)
            if mapped is None or mapped is exc:
                raise
            raise mapped from exc

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.engine.dispose()
