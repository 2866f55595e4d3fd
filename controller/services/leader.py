"""Leader election: of the controller replicas on one database, exactly one acts.

Every replica serves HTTP and migrates or checks the schema, but only the leader loads the
cluster state, commits reports and runs the periodic tasks (detectors, power loop, command
expiry). Two acting replicas would open every incident twice, send every power cap twice
and overwrite each other's rows from diverging in-memory state.

The lock is the database's own, so leadership needs nothing the controller does not
already depend on:

* **PostgreSQL**: a session-level ``pg_try_advisory_lock(key)`` held by a dedicated psycopg
  connection (not one of the SQLAlchemy pool's). The server drops the lock when that
  session ends: at once when the process dies (the kernel closes the socket), within
  :data:`PG_SERVER_DETECT_S` when the host or network dies (server-side TCP keepalives and
  ``tcp_user_timeout``, set on the session). The leader checks every ``check_interval_s``
  that ``pg_locks`` still shows the lock as its own; a check that fails or takes longer
  than :data:`PG_CHECK_TIMEOUT_S` means lost. So a partitioned leader stops acting
  (≤ check interval + timeout = 3 s) before the server can hand the lock on (≥ 8 s).
* **SQLite**: an exclusive ``flock`` on ``<database file>.leader``. The kernel drops it when
  the process dies; it cannot be lost while the process lives, except by someone deleting
  the file (a second controller would then lock a new file), which the check catches by
  comparing inodes.
* **off** (``leader_election: false``, or an in-memory SQLite database): always the leader.

A standby tries to take the lock every ``retry_interval_s``. A leader that loses it never
campaigns again: its in-memory state may be behind what the next leader writes, so the
controller fences itself (stops every periodic task, refuses API calls) and the process
exits for the orchestrator to restart it (``controller.server.serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sqlalchemy.engine import make_url

from controller.tasks import cancel_and_wait

if TYPE_CHECKING:
    from psycopg import AsyncConnection

log = logging.getLogger(__name__)

#: Seconds one liveness query on the lock connection may take before the lock counts as lost.
PG_CHECK_TIMEOUT_S = 2.0
#: Seconds to open the lock connection.
PG_CONNECT_TIMEOUT_S = 3
#: Server-side detection of a dead leader host: keepalive idle 5 s + 3 probes 1 s apart, and
#: at most 8 s of unacknowledged data (``tcp_user_timeout``). Bounds takeover after a host or
#: network failure; a killed process releases the lock at once.
PG_KEEPALIVE_IDLE_S = 5
PG_KEEPALIVE_INTERVAL_S = 1
PG_KEEPALIVE_COUNT = 3
PG_SERVER_DETECT_S = PG_KEEPALIVE_IDLE_S + PG_KEEPALIVE_INTERVAL_S * PG_KEEPALIVE_COUNT

Role = Literal["starting", "standby", "leader", "lost", "stopped"]

STANDBY_DETAIL = "standby: another controller replica is the leader"
LOST_DETAIL = "leadership lost: this replica stopped acting and must be restarted"
STARTING_DETAIL = "starting: electing a leader"


class LeadershipLost(Exception):
    """The lock is gone, or can no longer be shown to be held."""


class LeaderLock(Protocol):
    """One backend's lock. Only the elector's task calls these, one at a time."""

    #: What is locked, for logs ("postgresql advisory lock 123", "flock /x.db.leader").
    description: str

    async def try_acquire(self) -> bool:
        """Take the lock if free; False if another replica holds it. May raise on I/O errors."""

    async def check(self) -> None:
        """Raise :class:`LeadershipLost` unless the lock is still certainly ours."""

    async def release(self) -> None:
        """Let go (idempotent); the next replica may take over at once."""


def advisory_key(name: str) -> int:
    """A stable signed 64-bit key for ``pg_try_advisory_lock`` from the election name."""
    digest = hashlib.sha256(f"trainguard-leader:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class AlwaysLeader:
    """Election off: this replica is the only one (the operator promised so)."""

    description = "no election"

    async def try_acquire(self) -> bool:
        return True

    async def check(self) -> None:
        return None

    async def release(self) -> None:
        return None


class FileLock:
    """``flock(LOCK_EX)`` on a lock file next to the SQLite database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"flock {path}"
        self._fd: int | None = None

    async def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # For a human wondering who holds it; the lock itself is the flock, not the content.
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return True

    async def check(self) -> None:
        if self._fd is None:
            raise LeadershipLost("lock file not held")
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            raise LeadershipLost(f"lock file {self.path} was deleted") from None
        if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
            raise LeadershipLost(f"lock file {self.path} was replaced")

    async def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class PostgresAdvisoryLock:
    """Session-level advisory lock on a dedicated connection kept open while standby too."""

    def __init__(self, database_url: str, name: str) -> None:
        self.key = advisory_key(name)
        unsigned = self.key & 0xFFFF_FFFF_FFFF_FFFF
        #: ``pg_locks`` shows a bigint advisory key as (classid = high 32 bits, objid = low).
        self._classid, self._objid = unsigned >> 32, unsigned & 0xFFFF_FFFF
        url = make_url(database_url).set(drivername="postgresql")
        self._conninfo = url.render_as_string(hide_password=False)
        self.description = f"postgresql advisory lock {self.key} ({name!r})"
        self._conn: AsyncConnection[tuple[Any, ...]] | None = None

    @property
    def backend_pid(self) -> int | None:
        """The lock session's server process id (``pg_terminate_backend`` target in tests)."""
        conn = self._connection()
        return None if conn is None else conn.info.backend_pid

    def _connection(self) -> AsyncConnection[tuple[Any, ...]] | None:
        conn = self._conn
        return None if conn is None or conn.closed else conn

    async def _connect(self) -> AsyncConnection[tuple[Any, ...]]:
        import psycopg  # here, so a SQLite-only controller never loads libpq

        conn = await psycopg.AsyncConnection.connect(
            self._conninfo,
            autocommit=True,
            connect_timeout=PG_CONNECT_TIMEOUT_S,
            application_name="trainguard-leader",
            keepalives=1,
            keepalives_idle=PG_KEEPALIVE_IDLE_S,
            keepalives_interval=PG_KEEPALIVE_INTERVAL_S,
            keepalives_count=PG_KEEPALIVE_COUNT,
            tcp_user_timeout=PG_SERVER_DETECT_S * 1000,
        )
        self._conn = conn
        # The server side matters most: it is what frees the lock when our host vanishes.
        for setting, value in (
            ("tcp_keepalives_idle", PG_KEEPALIVE_IDLE_S),
            ("tcp_keepalives_interval", PG_KEEPALIVE_INTERVAL_S),
            ("tcp_keepalives_count", PG_KEEPALIVE_COUNT),
            ("tcp_user_timeout", PG_SERVER_DETECT_S * 1000),
        ):
            try:
                await self._query(conn, f"SET {setting} = {value}", fetch=False)
            except BaseException:
                self._abandon()
                raise
        return conn

    async def try_acquire(self) -> bool:
        conn = self._connection() or await self._connect()
        try:
            row = await self._query(conn, "SELECT pg_try_advisory_lock(%s)", (self.key,))
        except Exception:
            self._abandon()
            raise
        return bool(row and row[0])

    async def check(self) -> None:
        conn = self._connection()
        if conn is None:
            raise LeadershipLost("lock connection closed")
        query = (
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND pid = pg_backend_pid() AND classid::bigint = %s AND objid::bigint = %s"
            " AND objsubid = 1)"
        )
        try:
            row = await self._query(conn, query, (self._classid, self._objid))
        except Exception as exc:
            self._abandon()
            raise LeadershipLost(f"lock connection failed: {type(exc).__name__}") from exc
        if not (row and row[0]):
            self._abandon()
            raise LeadershipLost("the session no longer holds the advisory lock")

    async def release(self) -> None:
        conn = self._connection()
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._query(conn, "SELECT pg_advisory_unlock(%s)", (self.key,))
        self._abandon()

    async def _query(
        self,
        conn: AsyncConnection[tuple[Any, ...]],
        query: str,
        params: tuple[int, ...] = (),
        *,
        fetch: bool = True,
    ) -> tuple[Any, ...] | None:
        """One row of ``query``, or :class:`TimeoutError` after :data:`PG_CHECK_TIMEOUT_S`.

        Why not ``asyncio.wait_for``: cancelling a psycopg query waits for the server to
        cancel it (up to 10 s more on a server or network that stopped answering), and
        ``wait_for`` waits for that; a stalled check then took 12 s, past the server's
        hand-over to another replica (:data:`PG_SERVER_DETECT_S`). Here a late query's
        connection is given up at once (:meth:`_abandon`), closed once the query has ended.
        """

        async def run() -> tuple[Any, ...] | None:
            cursor = await conn.execute(query, params or None)
            return await cursor.fetchone() if fetch else None

        task = asyncio.ensure_future(run())
        try:
            done, _ = await asyncio.wait({task}, timeout=PG_CHECK_TIMEOUT_S)
        except asyncio.CancelledError:  # the caller stops: the query ends by itself
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"no answer within {PG_CHECK_TIMEOUT_S:g} s")
        return task.result()

    def _abandon(self, pending: asyncio.Future[Any] | None = None) -> None:
        """Drop the lock connection now and close it (the server ends the session, freeing
        the lock): at once, or once ``pending``, a query on it, has ended its cancellation
        (closing the socket under a query that still waits on it is unsafe for the loop)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if pending is not None and not pending.done():
            pending.cancel()
            pending.add_done_callback(lambda _: _finish(conn))
        else:
            _finish(conn)


def _finish(conn: AsyncConnection[tuple[Any, ...]]) -> None:
    """Close a psycopg connection without waiting for the server (``close`` does just this)."""
    with contextlib.suppress(Exception):
        conn.pgconn.finish()


def build_lock(
    database_url: str, *, enabled: bool, name: str
) -> AlwaysLeader | FileLock | PostgresAdvisoryLock:
    """The lock for this database: advisory lock, lock file, or none."""
    url = make_url(database_url)
    if not enabled:
        return AlwaysLeader()
    if url.get_backend_name() == "postgresql":
        return PostgresAdvisoryLock(database_url, name)
    database = url.database
    if not database or database == ":memory:":
        return AlwaysLeader()  # an in-memory database cannot be shared by two processes
    path = Path(database).expanduser()
    return FileLock(path.with_name(path.name + ".leader"))


class LeaderElector:
    """Campaign for the lock, keep checking it, and call back when won or lost.

    ``on_elected`` runs before :attr:`is_leader` turns true (the controller loads its state
    there); if it raises, the lock is released and the replica counts as lost. ``on_lost``
    runs once, right after :attr:`is_leader` turns false.
    """

    def __init__(
        self,
        lock: LeaderLock,
        *,
        retry_interval_s: float,
        check_interval_s: float,
        on_elected: Callable[[], Awaitable[None]],
        on_lost: Callable[[str], Awaitable[None]],
    ) -> None:
        self.lock = lock
        self.retry_interval_s = retry_interval_s
        self.check_interval_s = check_interval_s
        self._on_elected = on_elected
        self._on_lost = on_lost
        self.role: Role = "starting"
        #: Set while this replica leads; cleared when it loses or stops.
        self.elected = asyncio.Event()
        #: Monotonic time leadership began (None while not leading).
        self.since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""

    @property
    def is_leader(self) -> bool:
        return self.role == "leader"

    @property
    def detail(self) -> str:
        """One line for ``/readyz`` while this replica does not lead."""
        if self.role == "lost":
            return LOST_DETAIL
        if self.role == "stopped":
            return "stopped"
        if self.role == "starting":
            return STARTING_DETAIL
        return STANDBY_DETAIL

    async def start(self) -> None:
        """Try once now (a lone replica leads before serving), then keep trying in the
        background. An error from ``on_elected`` on this first try propagates."""
        if await self._campaign(raise_errors=True):
            log.info("elected leader", extra={"fields": {"lock": self.lock.description}})
        else:
            log.info(
                "standby: another replica is the leader",
                extra={"fields": {"lock": self.lock.description}},
            )
        self._task = asyncio.create_task(self._run(), name="tg-leader-election")

    async def stop_campaigning(self) -> None:
        """No election and no loss callbacks from now on; the lock stays held."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def stop(self) -> None:
        """Stop campaigning and release the lock (call after the last write)."""
        await self.stop_campaigning()
        self._set_role("stopped")
        await self.lock.release()

    async def _run(self) -> None:
        while self.role in ("standby", "leader"):
            if self.role == "standby":
                await asyncio.sleep(self.retry_interval_s)
                if await self._campaign(raise_errors=False):
                    log.warning(
                        "took over as leader", extra={"fields": {"lock": self.lock.description}}
                    )
                continue
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.lock.check()
            except LeadershipLost as exc:
                await self._lose(str(exc))

    async def _campaign(self, *, raise_errors: bool) -> bool:
        try:
            won = await self.lock.try_acquire()
        except Exception as exc:
            if raise_errors:
                raise
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if message != self._last_error:  # log each distinct failure once
                log.warning(
                    "leader election: cannot reach the lock", extra={"fields": {"error": message}}
                )
            self._last_error = message
            self._set_role("standby")
            return False
        self._last_error = ""
        if not won:
            self._set_role("standby")
            return False
        try:
            await self._on_elected()
        except asyncio.CancelledError:
            await self.lock.release()
            raise
        except Exception:
            await self.lock.release()
            if raise_errors:
                raise
            log.exception("taking over as leader failed; giving up leadership")
            await self._lose("taking over failed")
            return False
        self._set_role("leader")
        return True

    async def _lose(self, reason: str) -> None:
        self._set_role("lost")
        await self.lock.release()
        log.error(
            "lost leadership: stopping all actions",
            extra={"fields": {"reason": reason, "lock": self.lock.description}},
        )
        await self._on_lost(reason)

    def _set_role(self, role: Role) -> None:
        self.role = role
        if role == "leader":
            self.since = time.monotonic()
            self.elected.set()
        else:
            self.since = None
            self.elected.clear()


__all__ = [
    "LOST_DETAIL",
    "STANDBY_DETAIL",
    "AlwaysLeader",
    "FileLock",
    "LeaderElector",
    "LeaderLock",
    "LeadershipLost",
    "PostgresAdvisoryLock",
    "advisory_key",
    "build_lock",
]
