"""One controller's parts, wired together, with their start and stop order.

``Controller`` owns the engine, the in-memory state, the group-commit writer, the services
and the periodic tasks. The FastAPI app holds one in ``app.state.controller``; routers reach
services through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

from sqlalchemy import text
from sqlalchemy.orm import Session

from controller.auth import Authenticator
from controller.db.migrate import head_revision, is_up_to_date, revision_of, upgrade
from controller.db.repositories import history
from controller.db.session import make_engine
from controller.errors import NotMigrated
from controller.loader import load_state
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.detection import Ticker
from controller.services.detection.degraded import DegradedGpuDetector
from controller.services.detection.health import HealthDetector
from controller.services.detection.jobs import JobDetector
from controller.services.incidents import IncidentService
from controller.services.ingest import IngestService
from controller.services.leader import LeaderElector, build_lock
from controller.services.metrics import ControllerMetrics
from controller.services.power import build_power
from controller.services.remediation.metrics import RemediationCollector
from controller.services.remediation.wiring import build_remediation
from controller.services.traffic.service import build_traffic
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store
from controller.writer import GroupCommitWriter

log = logging.getLogger(__name__)

HISTORY_PRUNE_INTERVAL_S = 60.0
WAL_CHECKPOINT_INTERVAL_S = 1.0


def package_version() -> str:
    try:
        return version("trainguard")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def prepare_database(settings: ControllerSettings) -> None:
    """Migrate SQLite in place; refuse PostgreSQL that is not at the head revision."""
    if settings.database_kind() == "sqlite":
        upgrade(settings.database_url)
        return
    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    try:
        if not is_up_to_date(engine):
            raise NotMigrated(
                f"database schema is not at revision {head_revision()}: run "
                "`trainguard db upgrade` against this database, then start the controller"
            )
    finally:
        engine.dispose()


class Controller:
    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.version = package_version()
        self.database = settings.database_kind()
        self.store = Store(make_engine(settings.database_url))
        self.state = ClusterState()
        self.auth = Authenticator(
            settings.tokens, allow_anonymous_read=settings.allow_anonymous_read
        )
        #: Only the elected replica loads state and acts (``controller.services.leader``).
        self.leader = LeaderElector(
            build_lock(
                settings.database_url,
                enabled=settings.leader_election,
                name=settings.leader_election_name,
            ),
            retry_interval_s=settings.leader_retry_interval_s,
            check_interval_s=settings.leader_check_interval_s,
            on_elected=self._lead,
            on_lost=self._fence,
        )
        #: Called (with the reason) once this replica has stopped acting after losing the
        #: lock; ``controller.server.serve`` exits the process there for a clean restart.
        self.on_leadership_lost: Callable[[str], None] | None = None
        self._acting = False
        self.metrics = ControllerMetrics(
            self.state, lambda: self.store.commits, lambda: self.leader.is_leader
        )
        self.writer = GroupCommitWriter(
            self.store,
            self.state.row_for,
            flush_interval_s=settings.ingest_flush_interval_s,
            max_rows=settings.ingest_flush_max_rows,
        )
        self.writer.on_batch = self._on_batch
        self.incidents = IncidentService(self.state, self.store)
        self.commands = CommandService(
            self.state, self.writer, expire_after_s=settings.command_expire_after_s
        )
        self.health = HealthDetector(
            self.state,
            self.incidents,
            self.writer,
            node_lost_after_s=settings.node_lost_after_s,
        )
        self.degraded = DegradedGpuDetector(
            self.state,
            self.incidents,
            ecc_rise=settings.degraded_ecc_rise,
            ecc_window_s=settings.degraded_ecc_window_s,
            throttle_s=settings.degraded_throttle_s,
        )
        self.jobs = JobDetector(self.state, self.incidents, self.commands)
        self.traffic = build_traffic(settings, self.state, self.store)
        self.incidents.open_hooks.append(self.traffic.on_incident_opened)
        self.ingest = IngestService(
            self.state, self.writer, self.metrics, [self.health, self.degraded, self.jobs]
        )
        self.tickers: list[Ticker] = [self.health, self.degraded, self.commands, self.jobs]
        self.actions = ActionService(self.store)
        self.traffic.actions = self.actions
        self.power = build_power(
            settings, self.state, self.store, self.commands, self.incidents, self.actions
        )
        self.ingest.observers.append(self.power.loop)
        self.tickers.append(self.power.loop)
        #: Incidents -> actions (docs/remediation.md); acts only while this replica leads.
        self.remediation = build_remediation(settings, self, lambda: self.acting)
        self.metrics.registry.register(RemediationCollector(self.remediation))
        self.ingest.observers.append(self.remediation)
        self.tickers.append(self.remediation)
        self._tasks: list[asyncio.Task[None]] = []
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "not started")

    def _on_batch(self, reports: int, seconds: float) -> None:
        if reports:
            self.metrics.batch_reports.observe(reports)
        self.metrics.commit_seconds.observe(seconds)

    async def start(self) -> None:
        """Check the schema, then lead (if the lock is free) or wait as a standby."""
        await asyncio.to_thread(prepare_database, self.settings)
        await self.leader.start()

    async def _lead(self) -> None:
        """Everything only the leader does: load the state the last leader left, start acting."""
        await self.store.read(lambda session: load_state(session, self.state))
        await self.traffic.load()
        await self.power.start()
        await self.remediation.start()
        self.writer.start()
        for ticker in self.tickers:
            self._spawn(ticker.tick, ticker.tick_interval_s, type(ticker).__name__)
        self._spawn(self._prune_history, HISTORY_PRUNE_INTERVAL_S, "history-retention")
        if self.database == "sqlite":
            self._spawn(self._checkpoint_wal, WAL_CHECKPOINT_INTERVAL_S, "wal-checkpoint")
        self._acting = True
        log.info(
            "controller started",
            extra={
                "fields": {
                    "database": self.database,
                    "leader": self.leader.lock.description,
                    "nodes": len(self.state.nodes),
                    "open_incidents": len(self.state.incidents),
                }
            },
        )

    async def _fence(self, reason: str) -> None:
        """Lock lost: stop every periodic task now; the API refuses calls from here on."""
        self._acting = False
        await self._stop_tasks()
        if self.on_leadership_lost is not None:
            self.on_leadership_lost(reason)

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.traffic.stop()

    async def stop(self) -> None:
        await self.leader.stop_campaigning()
        self._acting = False
        await self._stop_tasks()
        await self.remediation.close()
        await self.writer.close()
        # Released after the last commit, so the next leader loads everything we wrote.
        await self.leader.stop()
        await asyncio.to_thread(self.store.close)

    @property
    def acting(self) -> bool:
        """This replica leads and has loaded its state: it may change the cluster."""
        return self._acting and self.leader.is_leader

    def _spawn(self, fn: Callable[[float], Awaitable[None]], interval_s: float, name: str) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await fn(time.time())
                except Exception:  # a bad tick must not end the loop
                    log.exception("periodic task failed", extra={"fields": {"task": name}})

        self._tasks.append(asyncio.create_task(loop(), name=f"tg-{name}"))

    async def _prune_history(self, now: float) -> None:
        cutoff = now - self.settings.history_retention_s

        await self.store.write(lambda conn: history.prune_history(conn, cutoff))

    async def _checkpoint_wal(self, _now: float) -> None:
        """Copy the SQLite WAL into the database file off the commit path.

        Left to SQLite, the checkpoint (4 MB copied and fsynced) runs inside whichever
        commit crosses ``wal_autocheckpoint`` and stalls every report waiting on it; a
        ``PASSIVE`` checkpoint from another thread waits for nobody and blocks nobody.
        """

        def checkpoint(session: Session) -> None:
            session.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))

        await self.store.read(checkpoint)

    @property
    def alive(self) -> bool:
        """A standby (no writer yet) is alive; a leader is alive while its writer runs."""
        return self.writer.alive or not self._acting

    async def ready(self) -> tuple[bool, str]:
        """Database reachable and schema at or past this release's head (cached for 0.5 s).

        A healthy standby is ready too: a rollout or a drain must not wait for a replica that
        cannot lead while another holds the lock. Traffic reaches the leader by its pod label
        (the chart's leader-label sidecar, docs/kubernetes.md "Upgrades"), not by readiness.
        A replica that lost the lock is not ready (it exits and comes back as a standby).
        A schema revision this release does not know was written by a newer release, whose
        expand-only migrations keep this one working; one it knows but is not head is behind.
        """
        if self.leader.role in ("lost", "stopped"):
            return False, self.leader.detail
        at, ok, detail = self._ready_cache
        if time.monotonic() - at < 0.5:
            return ok, detail

        def check(session: Session) -> bool:
            from alembic.script import ScriptDirectory
            from alembic.util.exc import CommandError

            from controller.db.migrate import alembic_config

            session.execute(text("SELECT 1"))
            current = revision_of(session.connection())
            if current == head_revision():
                return True
            if current is None:
                return False
            try:
                ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision(current)
            except CommandError:
                return True  # newer than this release: accepted
            return False

        try:
            ok = await asyncio.wait_for(self.store.read(check), timeout=5.0)
            detail = "" if ok else "database schema is behind; run `trainguard db upgrade`"
        except Exception as exc:
            ok, detail = False, f"database unreachable: {type(exc).__name__}"
        if ok and self.acting and not self.writer.alive:
            ok, detail = False, "group-commit writer stopped"
        self._ready_cache = (time.monotonic(), ok, detail)
        return ok, detail
