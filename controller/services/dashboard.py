"""What the dashboard reads that the rest of the API does not keep: a live change feed,
recent step times per rank, recent power draw and goodput (its database reads are in
``controller.services.dashboard_reads``).

Data flow (the feed is built and subscribed in ``controller.runtime.compose``)::

    bus --NodeReported--> DashboardFeed --> StepRecorder (job -> step -> rank -> seconds)
                             |          --> PowerHistory (domain -> (t, watts)), every 5 s
                             |          --> GoodputHistory (job -> (t, ETTR)), every 5 s
                             v
          one task per controller, while some browser listens: every tick (woken by a
          report, at least once a second) diff the in-memory state against what it last
          sent, and put one pre-encoded SSE message on every subscriber's bounded queue.

The feed is a change feed over ``ClusterState`` (not the database): a browser gets a full
fleet snapshot when it connects and then only the nodes whose shown fields changed, plus
"topics changed" hints (incidents, jobs, actions, checkpoints, power) on which pages fetch
again. A subscriber that falls behind (its queue is full) is sent a full snapshot instead of
the deltas it missed, so it can never show a stale cell. Every store here is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.db.models import Action, Checkpoint
from controller.logic.world_size import WorldSize, outside_world
from controller.state import ClusterState
from trainguard import wire

log = logging.getLogger(__name__)

#: Steps kept per job; fewer for very wide jobs (see ``StepRecorder.max_cells``).
STEPS_KEPT = 240
#: Seconds a step may still be arriving from other ranks' agents (a few report intervals).
SETTLE_S = 3.0
#: Jobs whose steps are kept (least recently reporting dropped first).
JOBS_KEPT = 32
#: Seconds between power samples, and samples kept (one hour at 5 s).
POWER_EVERY_S = 5.0
POWER_KEPT = 720
#: A node whose last report is older than this share of ``node_lost_after_s`` shows as
#: "unreachable" (10 s of the default 30 s) until the health detector calls it lost.
SILENT_SHARE = 1 / 3
#: Messages a slow browser may have queued before it is resynchronized with a snapshot.
QUEUE_MAX = 64
#: Feed tick bounds: at most every MIN_TICK_S (coalescing a burst of reports), at least
#: every MAX_TICK_S (ages and detector-made changes that no report wakes).
MIN_TICK_S = 0.25
MAX_TICK_S = 1.0
#: Seconds between the database probes for new actions and checkpoints.
DB_PROBE_S = 2.0


class _Store(Protocol):
    async def read(self, fn: Any) -> Any: ...


class _Power(Protocol):
    def view(self) -> Any: ...


# ---------------------------------------------------------------------- step times


def _new_epoch() -> str:
    """A token unique across replicas and controller restarts: a page that merged step
    deltas under one epoch must fetch the whole matrix again when the answer names another
    (the job restarted and step numbers went back, or its world size changed)."""
    return uuid.uuid4().hex[:12]


@dataclass(slots=True)
class _JobSteps:
    steps: OrderedDict[int, dict[int, float]] = field(default_factory=OrderedDict)
    ends: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    #: rank -> (pp_stage, dp_rank, tp_rank, size of its peer group), as its steps say.
    layout: dict[int, tuple[int | None, int | None, int | None, int]] = field(default_factory=dict)
    world: WorldSize = field(default_factory=WorldSize)
    #: rank -> the step it reported last: a lower one means the job restarted.
    rank_steps: dict[int, int] = field(default_factory=dict)
    #: Changes whenever steps the page holds may no longer be this job's (see ``_new_epoch``).
    epoch: str = field(default_factory=_new_epoch)


class StepRecorder:
    """Recent step time per (rank, step) per job, for the heatmap and evidence charts.

    Bounded in cells, not just steps: a 16k-rank job keeps ``max_cells // 16384`` steps.
    """

    def __init__(self, *, steps_kept: int = STEPS_KEPT, jobs_kept: int = JOBS_KEPT) -> None:
        self.steps_kept = steps_kept
        self.jobs_kept = jobs_kept
        self.max_cells = 500_000
        self.jobs: OrderedDict[str, _JobSteps] = OrderedDict()

    def record(self, summary: wire.StepSummary, received: float) -> None:
        job = self.jobs.get(summary.job)
        if job is None:
            job = self.jobs[summary.job] = _JobSteps()
            while len(self.jobs) > self.jobs_kept:
                self.jobs.popitem(last=False)
        else:
            self.jobs.move_to_end(summary.job)
        world_before = job.world.value
        world_size = job.world.observe(summary.rank, summary.world_size, received)
        if outside_world(summary.rank, world_size):
            return  # a lone claim of a larger world: no row of the heatmap (as in detection)
        went_back = summary.step < job.rank_steps.get(summary.rank, summary.step)
        job.rank_steps[summary.rank] = summary.step
        if went_back or (world_before and world_size != world_before):
            job.epoch = _new_epoch()
        if summary.role:
            job.roles[summary.rank] = summary.role
        job.layout[summary.rank] = (
            summary.pp_stage,
            summary.dp_rank,
            summary.tp_rank,
            len(summary.group_ranks),
        )
        row = job.steps.get(summary.step)
        if row is None:
            if job.steps and summary.step < next(iter(job.steps)):
                return  # older than everything kept
            row = job.steps[summary.step] = {}
            if len(job.steps) > 1 and summary.step < next(reversed(job.steps)):
                job.steps = OrderedDict(sorted(job.steps.items()))  # a restart went back
        row[summary.rank] = summary.step_time_s
        end = summary.end_unix_s if summary.end_unix_s is not None else received
        job.ends[summary.step] = max(job.ends.get(summary.step, 0.0), end)
        keep = min(self.steps_kept, max(8, self.max_cells // max(1, world_size)))
        while len(job.steps) > keep:
            old, _ = job.steps.popitem(last=False)
            job.ends.pop(old, None)

    def matrix(
        self, name: str, last: int, now: float, after: int | None = None
    ) -> dict[str, Any] | None:
        """The newest ``last`` shown steps; with ``after``, only those newer than it (a
        delta the page merges) unless it cannot be merged: then the whole window, with
        ``incremental`` false and the ``reason`` (docs/dashboard.md "Incremental steps")."""
        job = self.jobs.get(name)
        if job is None:
            return None
        window = self._shown(job, now)[-last:]
        reason = None if after is None else _unmergeable(window, job, after)
        shown = window if after is None or reason else [s for s in window if s > after]
        return {
            **self._body(name, job, shown),
            "epoch": job.epoch,
            "after": after,
            "incremental": after is not None and reason is None,
            "reason": reason,
            "first_step": window[0] if window else None,
            "next_after": _next_after(job, window, now),
        }

    @staticmethod
    def _shown(job: _JobSteps, now: float) -> list[int]:
        steps = sorted(job.steps)
        # The newest steps are often still arriving (agents report on their own phases): leave
        # them out while they are less complete than the fullest kept step and younger than
        # SETTLE_S, or a step's median would be one early rank's time. Older incomplete
        # steps stay: a rank that stopped reporting shows as a gap.
        full = max((len(row) for row in job.steps.values()), default=0)
        while (
            len(steps) > 1
            and len(job.steps[steps[-1]]) < full
            and job.ends.get(steps[-1], 0.0) > now - SETTLE_S
        ):
            steps.pop()
        return steps

    @staticmethod
    def _body(name: str, job: _JobSteps, steps: list[int]) -> dict[str, Any]:
        ranks = sorted({r for s in steps for r in job.steps[s]})
        medians: list[float | None] = []
        maxima: list[float | None] = []
        for s in steps:
            values = sorted(job.steps[s].values())
            medians.append(values[len(values) // 2] if values else None)
            maxima.append(values[-1] if values else None)
        return {
            "job": name,
            "world_size": job.world.value,
            "steps": steps,
            "end_unix_s": [job.ends.get(s) for s in steps],
            "median_s": medians,
            "max_s": maxima,
            "ranks": [
                {
                    "rank": r,
                    "role": job.roles.get(r),
                    **dict(
                        zip(
                            ("pp_stage", "dp_rank", "tp_rank", "peer_group_size"),
                            job.layout.get(r, (None, None, None, 0)),
                            strict=True,
                        )
                    ),
                    "step_time_s": [job.steps[s].get(r) for s in steps],
                }
                for r in ranks
            ],
        }


def _unmergeable(window: list[int], job: _JobSteps, after: int) -> str | None:
    """Why steps newer than ``after`` cannot simply be appended to a page holding the
    window up to ``after``: ``steps_went_back`` (nothing kept reaches ``after``: the job
    restarted lower, or this controller started since), ``gap`` (``after`` is older than
    the window: the delta would be the whole window anyway). None: mergeable."""
    newest = next(reversed(job.steps), -1)  # kept sorted by ``record``
    if after > newest:
        return "steps_went_back"
    if window and after < window[0] - 1:
        return "gap"
    return None


def _next_after(job: _JobSteps, window: list[int], now: float) -> int:
    """The ``after`` the page's next request should carry: its newest step, or the one
    before the oldest shown step that may still change (not every rank in it yet, younger
    than SETTLE_S), so that step is sent again. -1: ask from the start."""
    full = max((len(row) for row in job.steps.values()), default=0)
    for i, s in enumerate(window):
        if len(job.steps[s]) < full and job.ends.get(s, 0.0) > now - SETTLE_S:
            return window[i - 1] if i else -1
    return window[-1] if window else -1


# ---------------------------------------------------------------------- power


class PowerHistory:
    """Each power domain's draw every ``POWER_EVERY_S``, the last ``POWER_KEPT`` samples.

    In memory: it starts empty when the controller starts (the page says so).
    """

    def __init__(self, *, every_s: float = POWER_EVERY_S, kept: int = POWER_KEPT) -> None:
        self.every_s = every_s
        self.samples: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=kept)

    def maybe_sample(self, power: _Power, now: float) -> None:
        if self.samples and now - self.samples[-1][0] < self.every_s:
            return
        view = power.view()
        if not view.enabled or not view.data:
            return
        self.samples.append((now, {d.name: d.power_w for d in view.data[:64]}))

    def series(self, since: float) -> dict[str, Any]:
        rows = [(t, v) for t, v in self.samples if t >= since]
        names = sorted({n for _, v in rows for n in v})
        return {
            "every_s": self.every_s,
            "domains": {
                n: {"t": [t for t, _ in rows], "power_w": [v.get(n) for _, v in rows]}
                for n in names
            },
        }


class GoodputHistory:
    """Each job's goodput (ETTR) every ``every_s`` while it reports steps, ``kept`` samples
    per job (one hour at 5 s), for the job page's goodput-over-time chart. In memory."""

    def __init__(
        self, *, every_s: float = POWER_EVERY_S, kept: int = POWER_KEPT, jobs_kept: int = JOBS_KEPT
    ) -> None:
        self.every_s = every_s
        self.kept = kept
        self.jobs_kept = jobs_kept
        self.samples: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()

    def maybe_sample(self, job: str, ettr: Callable[[str], float | None], now: float) -> None:
        series = self.samples.get(job)
        if series and now - series[-1][0] < self.every_s:
            return
        value = ettr(job)
        if value is None:
            return
        if series is None:
            series = self.samples[job] = deque(maxlen=self.kept)
            while len(self.samples) > self.jobs_kept:
                self.samples.popitem(last=False)
        series.append((now, value))

    def series(self, job: str) -> dict[str, list[float]]:
        rows = list(self.samples.get(job, ()))
        return {"t": [t for t, _ in rows], "ettr": [v for _, v in rows]}


# ---------------------------------------------------------------------- the feed


def _sse(event: str, data: dict[str, Any]) -> bytes:
    body = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"event: {event}\ndata: {body}\n\n".encode()


RESYNC = b""  # queued to a subscriber that fell behind: send it a snapshot
#: Queued to every subscriber when the feed closes (the controller stops): end the stream.
#: No real message equals it (they all begin ``event:``).
CLOSE = b"close"


@dataclass(eq=False, slots=True)
class Subscription:
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(QUEUE_MAX))
    #: Times this subscriber fell behind (its queue overflowed) since it connected.
    dropped: int = 0
    #: Messages discarded since its last snapshot: the next snapshot tells the browser.
    missed: int = 0


def node_fields(
    state: ClusterState, now: float, incidents: dict[str, int], silent_after_s: float
) -> dict[str, Any]:
    """Compact per-node fields the fleet grid shows, keyed for a small snapshot."""
    out: dict[str, Any] = {}
    for node in state.nodes.values():
        last = node.last_report_unix_s
        out[node.name] = {
            "n": node.name,
            "h": node.health,
            "r": node.health_reason,
            "g": len(node.gpus),
            "b": node.gpus_unhealthy,
            "sim": node.backend == "sim",
            "i": incidents.get(node.name, 0),
            "iso": node.isolated_reason,
            "l": node.labels,
            "silent": node.health == "healthy" and last is not None and now - last > silent_after_s,
        }
    return out


def _rank_states(job: Any) -> tuple[str, ...]:
    return tuple(sorted(r.state for r in job.ranks.values()))


class DashboardFeed:
    """Change feed for ``GET /api/v1/stream`` and the small stores the dashboard reads.

    Registered as a report observer (``on_report``); when the controller's event bus
    lands it subscribes to report and incident events instead, with the same effect.
    """

    def __init__(
        self,
        state: ClusterState,
        store: _Store,
        power: _Power | None,
        *,
        node_lost_after_s: float = 30.0,
        ettr: Callable[[str], float | None] | None = None,
    ) -> None:
        self.state = state
        self.ettr = ettr
        self.goodput_history = GoodputHistory()
        self.silent_after_s = node_lost_after_s * SILENT_SHARE
        self.store = store
        self.power = power
        self.steps = StepRecorder()
        self.power_history = PowerHistory()
        self.subscribers: set[Subscription] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._nodes: dict[str, dict[str, Any]] = {}
        self._topics: dict[str, Any] = {}
        self._db_marks: tuple[Any, ...] = ()
        self._db_probed = 0.0
        self.closed = False

    # -- inputs

    async def on_report(self, report: wire.Report, received: float) -> None:
        jobs = set()
        for summary in report.job.steps:
            self.steps.record(summary, received)
            jobs.add(summary.job)
        if self.ettr is not None:
            for job in jobs:
                self.goodput_history.maybe_sample(job, self.ettr, received)
        if self.power is not None:
            self.power_history.maybe_sample(self.power, received)
        self._wake.set()

    async def on_node_reported(self, event: Any) -> None:
        """``NodeReported`` from the event bus."""
        await self.on_report(event.report, event.received_unix_s)

    async def on_incident_opened(self, _event: Any) -> None:
        """``IncidentOpened`` from the event bus: show it now, not at the next tick."""
        self._wake.set()

    # -- subscribers

    def subscribe(self) -> Subscription:
        sub = Subscription()
        self.subscribers.add(sub)
        if self.closed:
            _end(sub)
        elif self._task is None or self._task.done():
            self._prime()
            self._task = asyncio.create_task(self._run(), name="dashboard-feed")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers and self._task is not None:
            self._task.cancel()
            self._task = None

    def close(self) -> None:
        """End every stream, now and from now on: the controller stops. Each subscriber's
        queue is emptied and gets ``CLOSE``, so its stream ends within one event-loop turn
        and the server's graceful shutdown does not wait out its timeout on them (an open
        stream never ends by itself); the page reconnects, to another replica. Idempotent."""
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for sub in list(self.subscribers):
            _end(sub)

    def snapshot(self, missed: int = 0) -> bytes:
        """The whole fleet as one ``nodes`` message (sent on connect and on resync; a
        resync says how many messages the subscriber missed, so the page can say so)."""
        now = time.time()
        nodes = node_fields(self.state, now, self._incidents_by_node(), self.silent_after_s)
        data: dict[str, Any] = {"t": now, "full": True, "data": list(nodes.values())}
        if missed:
            data["missed"] = missed
        return _sse("nodes", data)

    def resync(self, sub: Subscription) -> bytes:
        """The snapshot a subscriber that fell behind gets instead of what it missed."""
        missed, sub.missed = sub.missed, 0
        return self.snapshot(missed)

    # -- the loop

    def _incidents_by_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for inc in self.state.incidents.values():
            if inc.node:
                counts[inc.node] = counts.get(inc.node, 0) + 1
        return counts

    def _prime(self) -> None:
        self._nodes = node_fields(
            self.state, time.time(), self._incidents_by_node(), self.silent_after_s
        )
        self._topics = self._memory_topics()

    def _memory_topics(self) -> dict[str, Any]:
        incidents = tuple(
            sorted((i.id, i.count, i.updated_unix_s) for i in self.state.incidents.values())
        )
        jobs = tuple(
            sorted(
                (
                    j.name,
                    j.last_step,
                    j.world_size,
                    tuple(sorted(r.state for r in j.ranks.values())),
                )
                for j in self.state.jobs.values()
            )
        )
        power = None
        if self.power is not None and self.power_history.samples:
            power = self.power_history.samples[-1][0]
        return {"incidents": hash(incidents), "jobs": hash(jobs), "power": power}

    async def _db_topics(self) -> dict[str, Any]:
        def probe(session: Session) -> tuple[Any, ...]:
            actions = session.execute(
                select(func.max(Action.id), func.max(Action.finished_unix_s))
            ).one()
            checkpoints = session.execute(select(func.max(Checkpoint.id))).scalar()
            return (tuple(actions), checkpoints)

        now = time.monotonic()
        if now - self._db_probed >= DB_PROBE_S:
            self._db_probed = now
            self._db_marks = await self.store.read(probe)
        marks = self._db_marks or ((None, None), None)
        return {"actions": marks[0], "checkpoints": marks[1]}

    def _broadcast(self, message: bytes) -> None:
        if self.closed:  # the queues hold CLOSE: nothing may push it out
            return
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(message)
            except asyncio.QueueFull:
                sub.dropped += 1
                sub.missed += 1  # this message
                while not sub.queue.empty():
                    if sub.queue.get_nowait() != RESYNC:
                        sub.missed += 1
                sub.queue.put_nowait(RESYNC)

    async def tick(self) -> None:
        """Send what changed since the last tick (one message per kind, encoded once)."""
        now = time.time()
        fresh = node_fields(self.state, now, self._incidents_by_node(), self.silent_after_s)
        changed = [v for k, v in fresh.items() if self._nodes.get(k) != v]
        removed = [k for k in self._nodes if k not in fresh]
        self._nodes = fresh
        if changed or removed:
            self._broadcast(_sse("nodes", {"t": now, "data": changed, "removed": removed}))
        topics = {**self._memory_topics(), **(await self._db_topics())}
        moved = sorted(k for k, v in topics.items() if self._topics.get(k, v) != v)
        for k in topics:
            self._topics.setdefault(k, topics[k])
        self._topics.update(topics)
        if moved:
            self._broadcast(_sse("changed", {"t": now, "topics": moved}))

    async def _run(self) -> None:
        while self.subscribers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=MAX_TICK_S)
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # a bad tick must not end the feed
                log.exception("dashboard feed tick failed")
            await asyncio.sleep(MIN_TICK_S)


def _end(sub: Subscription) -> None:
    """Drop what the subscriber has not taken yet (it reconnects and gets a snapshot) and
    queue ``CLOSE``: room is certain, the queue is empty."""
    while not sub.queue.empty():
        sub.queue.get_nowait()
    sub.queue.put_nowait(CLOSE)


__all__ = [
    "CLOSE",
    "RESYNC",
    "DashboardFeed",
    "GoodputHistory",
    "PowerHistory",
    "StepRecorder",
    "node_fields",
]
