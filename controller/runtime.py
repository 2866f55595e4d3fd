"""The composition root: every part of one controller replica, built once, and its
start/stop order.

:func:`compose` builds each service exactly once and hands it the collaborators it uses as
constructor arguments; the event subscriptions (who consumes which event) are listed there,
in one place. :class:`Controller` owns the lifecycle: leader election, the periodic tasks,
start and stop. The FastAPI app holds one in ``app.state.controller`` and its
:class:`~controller.services.container.Services` in ``app.state.services``; routers get the
services they use through FastAPI dependencies (``controller.api.deps``), never this module.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from controller.auth import Authenticator
from controller.db.errors import database_away
from controller.db.migrate import (
    head_revision,
    refuse_foreign_tables,
    revision_of,
    schema_at_or_past_head,
    upgrade,
)
from controller.db.repositories import history
from controller.db.session import make_engine, probe_sqlite_write, sqlite_file_problem
from controller.errors import BadConfig, NotMigrated
from controller.loader import load_state
from controller.logic.detection.c4d import C4DConfig
from controller.logic.detection.cause import OwnCap
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.container import Services
from controller.services.dashboard import DashboardFeed
from controller.services.detection.degraded import DegradedGpuDetector
from controller.services.detection.health import HealthDetector
from controller.services.detection.jobs import JobDetector, JobFindingsCollector
from controller.services.events import EventBus, IncidentOpened, JobRecordsReported, NodeReported
from controller.services.flight_evidence import FlightEvidence
from controller.services.incidents import IncidentService, IncidentWritesCollector
from controller.services.ingest import IngestService
from controller.services.leader import LeaderElector
from controller.services.lease_lock import build_leader_lock
from controller.services.metrics import ControllerMetrics, EventBusCollector
from controller.services.nodes import NodeRecords
from controller.services.platform_events import subscribe_platform_events
from controller.services.power import build_power
from controller.services.remediation.metrics import RemediationCollector
from controller.services.remediation.wiring import build_remediation
from controller.services.traffic.service import build_traffic
from controller.services.traffic.slowlink import SlowLinkReaction
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store
from controller.tasks import cancel_and_wait
from controller.writer import GroupCommitWriter

log = logging.getLogger(__name__)

HISTORY_PRUNE_INTERVAL_S = 60.0
#: Rows one ``gpu_history`` pruning transaction deletes at most: tens of milliseconds, so
#: the reports queued behind it on the writer thread wait that long, not a statement timeout.
HISTORY_PRUNE_CHUNK_ROWS = 5_000
#: Chunks one pruning tick runs at most (250,000 rows a minute): a backlog drains over
#: several ticks while the reports keep flowing between the chunks.
HISTORY_PRUNE_MAX_CHUNKS = 50
WAL_CHECKPOINT_INTERVAL_S = 1.0


def package_version() -> str:
    try:
        return version("trainguard")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def prepare_database(settings: ControllerSettings) -> None:
    """Migrate SQLite in place; refuse PostgreSQL whose schema is behind this release's head.

    A SQLite file that is read-only, not a database, damaged or a directory, and a
    database holding tables but no trainguard revision (another application's), are
    refused in one line naming them (:class:`BadConfig`) and left untouched: no retry can
    fix them, so the controller must not start "ready" and answer every report 503.

    A schema at or past head is accepted (:func:`schema_at_or_past_head`, shared with
    ``/readyz``): during a rollout the new release's migration runs before the old replicas
    restart, and its expand-only changes keep them working. SQLite written by a newer
    release is left as it is (this release cannot "upgrade" to a revision it lacks).
    """
    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            current = revision_of(conn)
            if current is None:  # never migrate (or ask for a migration) over others' tables
                refuse_foreign_tables(conn, settings.database_url)
        if engine.dialect.name == "sqlite":
            probe_sqlite_write(engine)
    except (DBAPIError, sqlite3.Error) as exc:
        problem = sqlite_file_problem(settings.database_url, exc)
        if problem is None:
            raise
        raise BadConfig(problem) from exc
    finally:
        engine.dispose()
    if settings.database_kind() == "sqlite":
        if current is None or not schema_at_or_past_head(current):
            upgrade(settings.database_url)
        return
    if not schema_at_or_past_head(current):
        raise NotMigrated(
            f"database schema is not at revision {head_revision()}: run "
            "`trainguard db upgrade` against this database, then start the controller"
        )


def compose(
    settings: ControllerSettings,
    *,
    on_elected: Callable[[], Awaitable[None]],
    on_lost: Callable[[str], Awaitable[None]],
    acting: Callable[[], bool],
) -> Services:
    """Build every service once, each with exactly what it uses, and subscribe the event
    consumers. ``on_elected``/``on_lost``/``acting`` are the lifecycle's (:class:`Controller`)."""
    store = Store(
        make_engine(settings.database_url),
        statement_timeout_s=settings.database_statement_timeout_s,
    )
    state = ClusterState()
    events = EventBus()
    auth = Authenticator(settings.tokens, allow_anonymous_read=settings.allow_anonymous_read)
    #: Only the elected replica loads state and acts (``controller.services.leader``).
    # The database's lock, or in a cluster a Lease that also fences the actuator's writes.
    lock, lease = build_leader_lock(settings)
    leader = LeaderElector(
        lock,
        retry_interval_s=settings.leader_retry_interval_s,
        check_interval_s=settings.leader_check_interval_s,
        on_elected=on_elected,
        on_lost=on_lost,
    )
    metrics = ControllerMetrics(state, lambda: store.commits, lambda: leader.is_leader)
    writer = GroupCommitWriter(
        store,
        state.row_for,
        flush_interval_s=settings.ingest_flush_interval_s,
        max_rows=settings.ingest_flush_max_rows,
        on_batch=metrics.observe_batch,
    )
    incidents = IncidentService(state, store, events)
    commands = CommandService(state, writer, expire_after_s=settings.command_expire_after_s)
    nodes = NodeRecords(state, writer)
    actions = ActionService(store)
    health = HealthDetector(state, incidents, writer, node_lost_after_s=settings.node_lost_after_s)
    degraded = DegradedGpuDetector(
        state,
        incidents,
        ecc_rise=settings.degraded_ecc_rise,
        ecc_window_s=settings.degraded_ecc_window_s,
        throttle_s=settings.degraded_throttle_s,
        bump_interval_s=settings.degraded_bump_interval_s,
        tick_interval_s=settings.degraded_tick_interval_s,
    )
    jobs = JobDetector(
        state,
        incidents,
        commands,
        config=C4DConfig(confirm_min_s=settings.c4d_confirm_min_s),
        tick_interval_s=settings.job_tick_interval_s,
        probe_lead_s=settings.probe_lead_s,
    )
    flight = FlightEvidence(state, incidents, commands)
    traffic = build_traffic(settings, state, store)
    slow_links = SlowLinkReaction(traffic, state, actions, nic_ports=jobs.nic_ports)
    power = build_power(settings, state, store, commands, incidents, actions)
    # A GPU held at the limit trainguard's own power policy sent is no hardware fault.
    jobs.own_caps = lambda node, gpu: OwnCap(limit_w=power.loop.tracker.power_limit_w(node, gpu))
    #: Incidents -> actions (docs/remediation.md); acts only while this replica leads.
    remediation = build_remediation(
        settings,
        state=state,
        store=store,
        incidents=incidents,
        commands=commands,
        actions=actions,
        nodes=nodes,
        is_leader=acting,
        lease=lease,
    )
    metrics.registry.register(RemediationCollector(remediation))
    metrics.registry.register(EventBusCollector(events))
    metrics.registry.register(IncidentWritesCollector(incidents))
    metrics.registry.register(JobFindingsCollector(jobs))
    ingest = IngestService(state, writer, metrics, events)
    dashboard = DashboardFeed(
        state,
        store,
        power,
        node_lost_after_s=settings.node_lost_after_s,
        ettr=remediation.ettr,
    )

    # Who consumes which event (docs/architecture.md lists them too).
    events.subscribe(
        NodeReported, lambda e: health.on_report(e.report, e.received_unix_s), name="health"
    )
    events.subscribe(
        NodeReported, lambda e: degraded.on_report(e.report, e.received_unix_s), name="degraded"
    )
    events.subscribe(
        NodeReported, lambda e: power.loop.on_report(e.report, e.received_unix_s), name="power"
    )
    events.subscribe(
        JobRecordsReported, lambda e: jobs.on_report(e.report, e.received_unix_s), name="jobs"
    )
    events.subscribe(JobRecordsReported, remediation.on_job_records, name="remediation")

    async def observe_ranks(e: JobRecordsReported) -> None:
        """The actuator learns where each rank runs (its pod, on Kubernetes)."""
        if remediation.actuator is not None and e.records.rank_events:
            remediation.actuator.observe_ranks(e.node, e.records.rank_events)

    events.subscribe(JobRecordsReported, observe_ranks, name="placement")
    events.subscribe(IncidentOpened, slow_links.on_incident_opened, name="slow-links")
    events.subscribe(IncidentOpened, lambda e: flight.on_incident_opened(e.incident), name="flight")
    events.subscribe(
        JobRecordsReported, lambda e: flight.on_report(e.report, e.received_unix_s), name="dumps"
    )
    events.subscribe(NodeReported, dashboard.on_node_reported, name="dashboard")
    events.subscribe(IncidentOpened, dashboard.on_incident_opened, name="dashboard-incidents")
    # Detections as platform Events, failed preflights as quarantines: the leader's only.
    subscribe_platform_events(
        events,
        lambda: remediation.actuator if acting() else None,
        commands.preflight_verdicts,
    )

    return Services(
        settings=settings,
        store=store,
        state=state,
        events=events,
        auth=auth,
        leader=leader,
        metrics=metrics,
        writer=writer,
        incidents=incidents,
        commands=commands,
        nodes=nodes,
        actions=actions,
        health=health,
        degraded=degraded,
        jobs=jobs,
        flight=flight,
        traffic=traffic,
        slow_links=slow_links,
        power=power,
        remediation=remediation,
        ingest=ingest,
        dashboard=dashboard,
        tickers=(health, degraded, commands, jobs, power.loop, remediation),
    )


@dataclass(slots=True)
class TickCount:
    """How far one periodic task has got. Ticks run one after another, so tick number
    ``started`` is over once ``finished + failed`` reaches it."""

    #: Ticks begun.
    started: int = 0
    #: Ticks that returned.
    finished: int = 0
    #: Ticks that raised (logged; the loop goes on).
    failed: int = 0


class Controller:
    """One replica's lifecycle: lead (load state, start the periodic tasks) or stand by."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.version = package_version()
        self.database = settings.database_kind()
        #: Called (with the reason) once this replica has stopped acting after losing the
        #: lock; ``controller.server.serve`` exits the process there for a clean restart.
        self.on_leadership_lost: Callable[[str], None] | None = None
        self._acting = False
        #: ``gpu_history`` pruning's bounds (tests lower them; see the constants).
        self.history_prune_chunk_rows = HISTORY_PRUNE_CHUNK_ROWS
        self.history_prune_max_chunks = HISTORY_PRUNE_MAX_CHUNKS
        self.services = s = compose(
            settings, on_elected=self._lead, on_lost=self._fence, acting=lambda: self.acting
        )
        # The parts the lifecycle (and tests) use by name.
        self.store, self.state, self.events, self.auth = s.store, s.state, s.events, s.auth
        self.leader, self.metrics, self.writer = s.leader, s.metrics, s.writer
        self.incidents, self.commands, self.actions = s.incidents, s.commands, s.actions
        self.traffic, self.power, self.remediation = s.traffic, s.power, s.remediation
        self.ingest, self.tickers = s.ingest, s.tickers
        self._tasks: list[asyncio.Task[None]] = []
        #: Each periodic task's ticks so far, by its name in ``_spawn`` (a ticker's class
        #: name, ``history-retention``, ``wal-checkpoint``). Read by tests: "nothing more
        #: happened" means something only once the task that would have done it has run,
        #: so they wait for its ticks rather than sleep; and when debugging, whether a task
        #: ticks at all and whether its ticks raise.
        self.ticks: dict[str, TickCount] = {}
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "not started")
        self._campaigning = False
        self._seen_ready = asyncio.Event()

    async def start(self, *, campaign: bool = True) -> None:
        """Check the schema, then lead (if the lock is free) or wait as a standby.

        ``campaign=False`` leaves the election to :meth:`campaign`, for a server that
        campaigns only once it answers requests (``controller.server.serve``).
        """
        await asyncio.to_thread(prepare_database, self.settings)
        if campaign:
            await self.campaign()

    async def campaign(self) -> None:
        """Try for the lock once now, then keep trying in the background (once only).

        Why a serving replica should be the one to campaign: a replica that wins the lock
        leads the cluster, and until it answers requests the API is down. A pod still
        starting during a rolling upgrade would otherwise take the lock the old leader
        just released from the standbys that already serve, then keep it unreachable for
        the rest of its start-up (a log under load showed "elected leader" 0.9 s before
        "Application startup complete") and, in a cluster, until the kubelet's next
        readiness probe (see ``leader_campaign_after_ready``).
        """
        if not self._campaigning:
            self._campaigning = True
            await self.leader.start()

    async def campaign_once_serving(self) -> None:
        """The server's campaign: at once, or with ``leader_campaign_after_ready`` once a
        readiness probe has been answered 200 (see the setting)."""
        if self.settings.leader_campaign_after_ready:
            await self._seen_ready.wait()
        await self.campaign()

    async def _lead(self) -> None:
        """Everything only the leader does: load the state the last leader left, start acting."""
        self.events.start()
        retention_s = self.settings.job_retention_s  # older jobs: only those still held
        await self.store.read(lambda s: load_state(s, self.state, retention_s=retention_s))
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
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        await self.events.stop()

    async def stop(self) -> None:
        self.services.dashboard.close()  # ends open streams (uvicorn's Server did already)
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
        ticks = self.ticks.setdefault(name, TickCount())

        async def loop() -> None:
            away = 0  # ticks in a row that failed with the database unavailable
            while True:
                await asyncio.sleep(interval_s)
                ticks.started += 1
                try:
                    await fn(time.time())
                except Exception as exc:  # a bad tick must not end the loop
                    ticks.failed += 1
                    if not database_away(exc):
                        away = 0
                        log.exception("periodic task failed", extra={"fields": {"task": name}})
                        continue
                    away += 1
                    if away == 1:  # the store logs the outage; each task says it once
                        log.warning(
                            "periodic task failed: database unavailable; retrying every tick",
                            extra={"fields": {"task": name, "error": str(exc)}},
                        )
                else:
                    ticks.finished += 1
                    away = 0

        self._tasks.append(asyncio.create_task(loop(), name=f"tg-{name}"))

    async def _prune_history(self, now: float) -> None:
        """Delete ``gpu_history`` past its retention, in chunks of their own transaction.

        One DELETE of everything due held the writer thread (and with it the group commit:
        every agent's report) for as long as it ran, and on PostgreSQL a backlog outran the
        statement timeout and was rolled back every tick, never done. Each chunk is queued
        on the writer thread like any write, so a batch of reports that arrived meanwhile
        commits before the next chunk; what the tick's cap leaves goes on the next tick.
        """
        cutoff = now - self.settings.history_retention_s
        limit = self.history_prune_chunk_rows
        for _ in range(self.history_prune_max_chunks):
            deleted = await self.store.write(
                lambda conn: history.prune_history(conn, cutoff, limit=limit)
            )
            if deleted < limit:
                return

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
        A replica that lost the lock is not ready (it exits and comes back as a standby),
        nor is one before its first try for the lock has ended: a probe that passes means
        the replica knows whether it leads, so a lone replica is the leader once Ready.
        Except with ``leader_campaign_after_ready``, where that first probe answered 200
        is what starts the campaign.
        A schema revision this release does not know was written by a newer release, whose
        expand-only migrations keep this one working; one it knows but is not head is behind.
        """
        role = self.leader.role
        if role in ("lost", "stopped") or (
            role == "starting" and not self.settings.leader_campaign_after_ready
        ):
            return False, self.leader.detail
        ok, detail = await self._check_ready()
        if ok and role == "starting":
            self._seen_ready.set()
        return ok, detail

    async def _check_ready(self) -> tuple[bool, str]:
        at, ok, detail = self._ready_cache
        if time.monotonic() - at < 0.5:
            return ok, detail

        def check(session: Session) -> bool:
            session.execute(text("SELECT 1"))
            return schema_at_or_past_head(revision_of(session.connection()))

        try:
            ok = await asyncio.wait_for(self.store.read(check), timeout=5.0)
            detail = "" if ok else "database schema is behind; run `trainguard db upgrade`"
        except Exception as exc:
            ok, detail = False, f"database unreachable: {type(exc).__name__}"
        if ok and self.acting and not self.writer.alive:
            ok, detail = False, "group-commit writer stopped"
        self._ready_cache = (time.monotonic(), ok, detail)
        return ok, detail
