"""Group commit: many reports, one transaction.

A request handler submits a :class:`Contribution` (rows to insert, keys of rows to upsert)
and awaits its future. The writer task wakes when work arrives, lets more arrive for
``flush_interval_s`` (or less, once ``max_rows`` rows wait), then commits everything queued
in one transaction on the store's writer thread, and only then resolves the futures, so a
report is acknowledged only once its rows are durable. While one commit runs the next batch
fills, so under load batches grow and the number of transactions per second stays bounded.

Upserts are typed *keys* (:mod:`controller.db.keys`), resolved to full rows from the
in-memory state at flush time (``row_for``), so one batch writes each entity once with its
newest values, whatever order reports arrived in; the rows are stored by the tables'
repositories (:func:`controller.db.repositories.write_batch`), never here.

If a commit fails, each report of the batch is retried alone, so one bad report cannot fail
its batch-mates (once no connection can be had at all, the rest are answered 503 at once,
not after one more connection attempt, and connect timeout, per report; a batch whose
statement timed out, on a hung server or a lock held elsewhere, is not retried report by
report at all: that would cost one more statement timeout per report); those that still
fail get the database's error as :mod:`controller.db.errors` maps it (422/409 for data it
refuses, 503 when it is away; their dedupe cursor is rolled back, so the agent's retry is
accepted) and their upsert keys are carried into the next batches, for a bounded number of
attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Connection, Table

from controller.db.errors import database_away, database_timed_out, database_unreachable
from controller.db.keys import RowKey
from controller.db.models import Base
from controller.db.repositories import write_batch
from controller.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A row whose write keeps failing is given up after this many batches (the in-memory
#: state still has it, and the next report touching it queues it again).
MAX_CARRY_ATTEMPTS = 3


@dataclass(slots=True)
class Contribution:
    #: Rows appended to append-only tables (``GpuHistory``, ``Checkpoint``), by model.
    inserts: dict[type[Base], list[dict[str, Any]]] = field(default_factory=dict)
    upserts: set[RowKey] = field(default_factory=set)
    on_commit: Callable[[], None] | None = None
    on_failure: Callable[[BaseException], None] | None = None
    future: asyncio.Future[None] | None = None

    def row_count(self) -> int:
        return len(self.upserts) + sum(len(rows) for rows in self.inserts.values())


@dataclass(slots=True)
class _Batch:
    contributions: list[Contribution]
    keys: set[RowKey]
    #: Keys carried from failed batches, with their failed attempts so far.
    carried: dict[RowKey, int]


class GroupCommitWriter:
    def __init__(
        self,
        store: Store,
        row_for: Callable[[RowKey], dict[str, Any] | None],
        *,
        flush_interval_s: float,
        max_rows: int,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self._store = store
        self._row_for = row_for
        self._interval_s = flush_interval_s
        self._max_rows = max_rows
        self._queue: list[Contribution] = []
        self._carry: dict[RowKey, int] = {}
        self._rows_queued = 0
        self._has_work = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.batches = 0
        self.last_error: str = ""
        #: Called with (reports in batch, seconds the commit took) after each commit.
        self.on_batch = on_batch

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tg-group-commit")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, contribution: Contribution) -> asyncio.Future[None]:
        """Queue rows; the returned future resolves once they are committed."""
        if self._closing:
            raise RuntimeError("writer is shutting down")
        contribution.future = asyncio.get_running_loop().create_future()
        self._queue.append(contribution)
        self._rows_queued += contribution.row_count()
        self._has_work.set()
        if self._rows_queued >= self._max_rows:
            self._full.set()
        return contribution.future

    async def run(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in a transaction of its own, after every contribution submitted
        before it (those still waiting for their batch are committed now, not after the
        interval), on the store's writer thread.

        For a change that must be durable *before* it is shown (write, then publish): the
        caller changes memory only once this returns. The order matters because ingest
        shows a report's rows in memory from the moment it submits them: a command queued
        for a node whose first report still waited for its batch referenced a node row that
        was not there yet (a foreign-key refusal, 409).
        """
        earlier = [c.future for c in self._queue if c.future is not None]
        if earlier:
            self._full.set()
            await asyncio.gather(*earlier, return_exceptions=True)
        return await self._store.write(fn)

    def mark_dirty(self, keys: set[RowKey]) -> None:
        """Write these rows with the next batch; nobody waits for them."""
        for key in keys:
            self._carry.setdefault(key, 0)
        self._has_work.set()

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        self._closing = True
        self._has_work.set()
        self._full.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while True:
            await self._has_work.wait()
            if not self._closing and self._interval_s > 0 and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self._interval_s)
            batch = self._take()
            if batch.contributions or batch.keys:
                await self._flush(batch)
            del batch  # don't keep the last batch's reports alive while idle
            if self._closing and not self._queue:
                return  # carried rows that failed are lost with the process; memory had them

    def _take(self) -> _Batch:
        contributions, self._queue = self._queue, []
        carried, self._carry = self._carry, {}
        keys = set(carried)
        for c in contributions:
            keys |= c.upserts
        self._rows_queued = 0
        self._has_work.clear()
        self._full.clear()
        return _Batch(contributions, keys, carried)

    async def _flush(self, batch: _Batch) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self._commit(batch.contributions, batch.keys)
        except Exception as exc:  # the database said no: find who, keep serving
            self._note_failure(exc, len(batch.contributions))
            several = len(batch.contributions) + bool(batch.carried) > 1
            if several and not _no_use_retrying(exc):
                await self._isolate(batch)
            else:
                self._fail(batch.contributions, exc, batch.carried)
            return
        self.batches += 1
        self.last_error = ""
        if self.on_batch is not None:
            self.on_batch(len(batch.contributions), loop.time() - started)
        for c in batch.contributions:
            _settle(c, None)

    async def _isolate(self, batch: _Batch) -> None:
        """Retry each report alone, so one bad row cannot fail its batch-mates."""
        own: set[RowKey] = set()
        unreachable: BaseException | None = None  # or hung: a statement timed out
        for c in batch.contributions:
            own |= c.upserts
            if unreachable is not None:  # no connection to be had: no more attempts
                self._fail([c], unreachable, batch.carried)
                continue
            try:
                await self._commit([c], c.upserts)
            except Exception as exc:
                self._fail([c], exc, batch.carried)
                if _no_use_retrying(exc):
                    unreachable = exc
            else:
                _settle(c, None)
        leftover = set(batch.carried) - own
        if leftover and unreachable is not None:
            self._fail([], unreachable, {k: batch.carried[k] for k in leftover})
        elif leftover:
            try:
                await self._commit([], leftover)
            except Exception as exc:
                self._fail([], exc, {k: batch.carried[k] for k in leftover})

    def _fail(
        self, contributions: list[Contribution], exc: BaseException, carried: dict[RowKey, int]
    ) -> None:
        keys = set(carried)
        for c in contributions:
            keys |= c.upserts
        dropped: list[RowKey] = []
        for key in keys:
            attempts = carried.get(key, 0) + 1
            if attempts < MAX_CARRY_ATTEMPTS:
                self._carry[key] = max(self._carry.get(key, 0), attempts)
            else:
                dropped.append(key)
        if dropped:
            # One line per batch, not per row; an outage is logged once, by the store.
            level = logging.DEBUG if database_away(exc) else logging.ERROR
            log.log(
                level,
                "dropping rows after repeated failures",
                extra={"fields": {"rows": len(dropped), "first": [str(k) for k in dropped[:5]]}},
            )
        if self._carry:
            self._has_work.set()
        for c in contributions:
            _settle(c, exc)

    def _note_failure(self, exc: BaseException, reports: int) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        # The database being away is logged once by the store, not once per batch.
        log.log(
            logging.DEBUG if database_away(exc) else logging.ERROR,
            "group commit failed",
            extra={"fields": {"reports": reports, "error": self.last_error}},
        )

    async def _commit(self, contributions: list[Contribution], keys: set[RowKey]) -> None:
        upserts: dict[Table, list[dict[str, Any]]] = {}
        for key in keys:
            row = self._row_for(key)
            if row is not None:
                upserts.setdefault(key.table, []).append(row)
        inserts: dict[Table, list[dict[str, Any]]] = {}
        for c in contributions:
            for model, rows in c.inserts.items():
                inserts.setdefault(model.__table__, []).extend(rows)  # type: ignore[arg-type]
        await self._store.write(lambda conn: write_batch(conn, upserts, inserts))


def _no_use_retrying(exc: BaseException) -> bool:
    """Whether retrying a failed batch's reports one by one would only fail each again:
    no connection to be had, or a statement timed out (a hung server, a lock held by
    another session), which says nothing about the report it ran for."""
    return database_unreachable(exc) or database_timed_out(exc)


def _settle(c: Contribution, exc: BaseException | None) -> None:
    try:
        if exc is None:
            if c.on_commit is not None:
                c.on_commit()
        elif c.on_failure is not None:
            c.on_failure(exc)
    except Exception:
        log.exception("group-commit callback failed")
    if c.future is not None and not c.future.done():
        if exc is None:
            c.future.set_result(None)
        else:
            c.future.set_exception(exc)
            # Nobody may await it (a cancelled request); don't warn about it.
            c.future.exception()
