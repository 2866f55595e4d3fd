"""Bounded buffers between the training thread and the shipping thread.

The training thread only appends; the shipping thread drains. Each kind of record has its
own bound so a flood of one (a long outage filling up step summaries) cannot push out the
rare, precious ones (a rank's exit event). When a buffer is full the oldest record goes and
a drop counter grows: fresh data matters more than old data to a detector.

A step summary's peer group (``group_ranks``: up to every rank of a pipeline stage, 2,000
at scale) is not shipped with every summary: :meth:`Outbox.drain` replaces the list by its
id (``wire.peer_group_id``) and adds the membership (``wire.PeerGroup``) to the batch the
first time an id goes out on a connection. :meth:`Outbox.registered` (a new connection to
the agent: this rank registers again) makes every id go out once more.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from trainguard.wire import (
    CheckpointEvent,
    FlightRecorderDump,
    InflightCollective,
    JobRecords,
    PeerGroup,
    ProbeResult,
    RankEvent,
    StepSummary,
    peer_group_id,
)

#: Peer groups a rank remembers (it has one at a time; a role change adds one).
_KNOWN_GROUPS = 64


class _Bounded:
    __slots__ = ("dropped", "items", "limit")

    def __init__(self, limit: int) -> None:
        self.items: deque[Any] = deque()
        self.limit = limit
        self.dropped = 0

    def append(self, item: Any) -> None:
        self.items.append(item)
        if len(self.items) > self.limit:
            self.items.popleft()
            self.dropped += 1

    def drain(self) -> list[Any]:
        out = []
        while self.items:
            try:
                out.append(self.items.popleft())
            except IndexError:  # pragma: no cover - emptied by another drainer
                break
        return out


#: Per-kind list limit of ``wire.JobRecords`` for in-flight reports and rank events.
_WIRE_LIMIT = 4_096


def _newest(buf: _Bounded, limit: int) -> list[Any]:
    """Drain ``buf``; keep the newest ``limit`` (the rest count as dropped)."""
    items = buf.drain()
    if len(items) > limit:
        buf.dropped += len(items) - limit
        items = items[-limit:]
    return items


class Outbox:
    """What this rank still has to deliver to its node agent."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self.steps = _Bounded(limit)
        self.inflight = _Bounded(limit)
        self.rank_events = _Bounded(limit)
        self.probes = _Bounded(limit)
        self.checkpoints = _Bounded(limit)
        self.traces = _Bounded(16)  # a dump is large and the newest one is what matters
        #: Peer group id -> its ranks, for every group a shipped summary named.
        self._known: dict[str, list[int]] = {}
        #: Ids whose membership went out on the current connection.
        self._declared: set[str] = set()
        self._last: tuple[list[int], str] | None = None

    def registered(self) -> None:
        """A new connection to the agent: declare each peer group again when next named."""
        with self._lock:
            self._declared.clear()

    def _group_id(self, ranks: list[int]) -> str:
        last = self._last
        if last is not None and (ranks is last[0] or ranks == last[0]):
            return last[1]
        gid = peer_group_id(ranks)
        self._last = (ranks, gid)
        self._known.pop(gid, None)
        self._known[gid] = sorted(set(ranks))
        while len(self._known) > _KNOWN_GROUPS:
            self._known.pop(next(iter(self._known)))
        return gid

    def _refer(self, steps: list[StepSummary]) -> list[PeerGroup]:
        """Replace each summary's ``group_ranks`` by its ``peer_group`` id (shipping thread;
        the summaries in :attr:`steps` keep their lists) and return the memberships not yet
        declared on this connection."""
        declare: list[PeerGroup] = []
        for i, step in enumerate(steps):
            if step.group_ranks:
                gid = self._group_id(step.group_ranks)
                steps[i] = step.model_copy(update={"group_ranks": [], "peer_group": gid})
            elif step.peer_group is not None:  # requeued after it was referred
                gid = step.peer_group
            else:
                continue
            ranks = self._known.get(gid)
            if gid not in self._declared and ranks is not None:
                self._declared.add(gid)
                declare.append(PeerGroup.model_construct(job=step.job, id=gid, ranks=ranks))
        return declare

    def add_step(self, record: StepSummary) -> None:
        with self._lock:
            self.steps.append(record)

    def add_inflight(self, record: InflightCollective) -> None:
        with self._lock:
            self.inflight.append(record)

    def add_event(self, record: RankEvent) -> None:
        with self._lock:
            self.rank_events.append(record)

    def add_probe(self, record: ProbeResult) -> None:
        with self._lock:
            self.probes.append(record)

    def add_checkpoint(self, record: CheckpointEvent) -> None:
        with self._lock:
            self.checkpoints.append(record)

    def add_trace(self, record: FlightRecorderDump) -> None:
        with self._lock:
            self.traces.append(record)

    def _buffers(self) -> tuple[_Bounded, ...]:
        return (
            self.steps,
            self.inflight,
            self.rank_events,
            self.probes,
            self.checkpoints,
            self.traces,
        )

    @property
    def dropped_total(self) -> int:
        return sum(b.dropped for b in self._buffers())

    def pending(self) -> int:
        return sum(len(b.items) for b in self._buffers())

    def drain(self, max_steps: int = 5_000) -> JobRecords:
        """Take a batch (its size is kept well under the frame limit)."""
        with self._lock:
            steps: list[StepSummary] = []
            while self.steps.items and len(steps) < max_steps:
                steps.append(self.steps.items.popleft())
            peer_groups = self._refer(steps)
            return JobRecords.model_construct(
                steps=steps,
                peer_groups=peer_groups,
                inflight=_newest(self.inflight, _WIRE_LIMIT),
                rank_events=_newest(self.rank_events, _WIRE_LIMIT),
                checkpoints=_newest(self.checkpoints, _WIRE_LIMIT),
                probes=_newest(self.probes, _WIRE_LIMIT),
                traces=_newest(self.traces, 4),
            )

    def requeue(self, batch: JobRecords) -> None:
        """Put back a batch the agent never received, ahead of newer records (its peer
        groups are declared again when the summaries naming them go out)."""
        with self._lock:
            for group in batch.peer_groups:
                self._declared.discard(group.id)
            for buf, items in (
                (self.steps, batch.steps),
                (self.inflight, batch.inflight),
                (self.rank_events, batch.rank_events),
                (self.probes, batch.probes),
                (self.checkpoints, batch.checkpoints),
                (self.traces, batch.traces),
            ):
                buf.items.extendleft(reversed(items))
                while len(buf.items) > buf.limit:
                    buf.items.popleft()
                    buf.dropped += 1


__all__ = ["Outbox"]
