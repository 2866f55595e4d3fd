"""The controller's in-process event bus: typed events, one queue per subscriber.

Services announce what happened (a report stored, an incident opened) as frozen
dataclasses; consumers subscribe by event *type*, so every consumer of an event is found by
searching for its class. Who publishes and who consumes each event is listed in
docs/architecture.md.

Delivery, per subscriber: events arrive in publish order, one at a time, in the
subscriber's own task; an exception is logged and the next event still comes.
:meth:`EventBus.publish` only queues. :meth:`EventBus.deliver` also waits, so that, for
example, a report's detectors have looked at it before the agent gets its reply; it waits at
most ``wait_s``. A subscriber that makes a publisher wait that long is marked *lagging* and
is not waited for again until it has emptied its queue, so one slow consumer delays the
publisher at most once, by ``wait_s``, and then not at all until it has caught up.

Leadership: the runtime stops the bus when the replica stops acting (queued events are
discarded, new ones ignored) and starts it when the replica leads again.

Overflow: each subscriber's queue holds ``queue_size`` events. When it is full the *new*
event is dropped for that subscriber only, counted in :attr:`Subscription.dropped` and
logged (the first drop and every 1000th), so a stuck consumer costs bounded memory and never
blocks the publisher or the other subscribers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from controller.tasks import cancel_and_wait

if TYPE_CHECKING:
    from controller.state import IncidentState
    from trainguard import wire

log = logging.getLogger(__name__)

#: Events a subscriber may have queued before new ones are dropped for it.
DEFAULT_QUEUE_SIZE = 1000
#: The longest a publisher waits for the subscribers that were keeping up.
DEFAULT_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class NodeReported:
    """An agent's report is durable (committed); ``received_unix_s`` is our clock.

    Published by :class:`~controller.services.ingest.IngestService`, once per stored report
    (never for a duplicate). The report carries the node's samples and its job records.
    """

    report: wire.Report
    received_unix_s: float


@dataclass(frozen=True, slots=True)
class JobRecordsReported:
    """A durable report carries job records (steps, checkpoints, in-flight calls, probes).

    Published by :class:`~controller.services.ingest.IngestService` right after
    :class:`NodeReported`, only for reports whose ``job`` records are not empty, so consumers
    of training-job telemetry are not woken for plain GPU samples.
    """

    report: wire.Report
    received_unix_s: float

    @property
    def node(self) -> str:
        return self.report.node.name

    @property
    def records(self) -> wire.JobRecords:
        return self.report.job


@dataclass(frozen=True, slots=True)
class IncidentOpened:
    """A new incident row exists (not a bump of an open one).

    Published by :class:`~controller.services.incidents.IncidentService`.
    """

    incident: IncidentState


Event = NodeReported | JobRecordsReported | IncidentOpened
E = TypeVar("E", NodeReported, JobRecordsReported, IncidentOpened)
Handler = Callable[[Any], Awaitable[None]]


@dataclass(eq=False)
class Subscription:
    """One consumer of one event type, with its own queue and task."""

    event_type: type[Any]
    handler: Handler
    name: str
    queue: asyncio.Queue[tuple[Any, asyncio.Future[None] | None]]
    dropped: int = 0
    delivered: int = 0
    #: Made a publisher wait ``wait_s`` in vain; not waited for until its queue is empty.
    lagging: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def backlog(self) -> int:
        return self.queue.qsize()


class EventBus:
    def __init__(
        self, *, queue_size: int = DEFAULT_QUEUE_SIZE, wait_s: float = DEFAULT_WAIT_S
    ) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        self._queue_size = queue_size
        self.wait_s = wait_s
        self._subscriptions: list[Subscription] = []
        #: Closed by :meth:`stop` (the replica stopped acting): events are ignored, so no
        #: consumer starts again on a stopped controller, until :meth:`start`.
        self._open = True

    def subscribe(
        self, event_type: type[E], handler: Callable[[E], Awaitable[None]], *, name: str
    ) -> Subscription:
        """Call ``handler`` with every ``event_type`` published from now on, in order."""
        sub = Subscription(event_type, handler, name, asyncio.Queue(self._queue_size))
        self._subscriptions.append(sub)
        return sub

    def subscriptions(self, event_type: type[Any] | None = None) -> list[Subscription]:
        return [s for s in self._subscriptions if event_type in (None, s.event_type)]

    def publish(self, event: Event) -> None:
        """Queue ``event`` for each of its subscribers and return at once."""
        self._queue(event, wait=False)

    async def deliver(self, event: Event) -> None:
        """Queue ``event``, then wait (at most ``wait_s``) until the subscribers that were
        keeping up have handled it; a subscriber with a backlog is not waited for."""
        waits = self._queue(event, wait=True)
        if not waits:
            return
        await asyncio.wait(waits.values(), timeout=self.wait_s)
        for sub, done in waits.items():
            if not done.done():
                sub.lagging = True

    def _queue(self, event: Event, *, wait: bool) -> dict[Subscription, asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        waits: dict[Subscription, asyncio.Future[None]] = {}
        if not self._open:
            return waits
        for sub in self._subscriptions:
            if not isinstance(event, sub.event_type):
                continue
            keep_up = wait and not sub.lagging
            done: asyncio.Future[None] | None = loop.create_future() if keep_up else None
            try:
                sub.queue.put_nowait((event, done))
            except asyncio.QueueFull:
                sub.dropped += 1
                if sub.dropped % 1000 == 1:
                    log.warning(
                        "event subscriber is behind; event dropped for it",
                        extra={
                            "fields": {
                                "subscriber": sub.name,
                                "event": type(event).__name__,
                                "dropped": sub.dropped,
                            }
                        },
                    )
                continue
            self._ensure_running(sub)
            if done is not None:
                waits[sub] = done
        return waits

    def _ensure_running(self, sub: Subscription) -> None:
        if sub.task is None or sub.task.done():
            sub.task = asyncio.get_running_loop().create_task(
                self._consume(sub), name=f"tg-events-{sub.name}"
            )

    async def _consume(self, sub: Subscription) -> None:
        while True:
            event, done = await sub.queue.get()
            try:
                await sub.handler(event)
            except Exception:  # a consumer bug must not end its subscription
                log.exception(
                    "event subscriber failed",
                    extra={"fields": {"subscriber": sub.name, "event": type(event).__name__}},
                )
            finally:
                sub.delivered += 1
                if done is not None and not done.done():
                    done.set_result(None)
                if sub.lagging and sub.queue.empty():
                    sub.lagging = False  # caught up: publishers wait for it again

    def start(self) -> None:
        """Accept events again (this replica leads); subscriber tasks start on demand."""
        self._open = True

    async def stop(self) -> None:
        """Stop every subscriber's task, discard what is queued and ignore events until
        :meth:`start` (this replica stopped acting)."""
        self._open = False
        tasks = [s.task for s in self._subscriptions if s.task is not None]
        await cancel_and_wait(tasks)
        for sub in self._subscriptions:
            sub.task = None
            sub.lagging = False
            while not sub.queue.empty():
                _, done = sub.queue.get_nowait()
                if done is not None and not done.done():
                    done.set_result(None)


__all__ = [
    "EventBus",
    "IncidentOpened",
    "JobRecordsReported",
    "NodeReported",
    "Subscription",
]
