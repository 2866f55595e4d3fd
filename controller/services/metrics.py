"""Prometheus metrics of one controller, in a registry of its own.

A per-app ``CollectorRegistry`` (not the process-global one) lets many controllers live in
one process (tests, the demo). Gauges about the cluster are custom collectors that read the
in-memory state at scrape time, so they can never go stale; a collector that fails yields
nothing rather than failing the scrape (metrics fail open).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.services.events import EventBus
from controller.state import ClusterState

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class ControllerMetrics:
    def __init__(
        self,
        state: ClusterState,
        db_commits: Callable[[], int],
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reports = Counter(
            "trainguard_ingest_reports", "Reports stored (duplicates excluded)", registry=r
        )
        self.duplicates = Counter(
            "trainguard_ingest_duplicate_reports",
            "Reports acknowledged as already stored (agent retries)",
            registry=r,
        )
        self.gpu_samples = Counter(
            "trainguard_ingest_gpu_samples", "GPU samples stored", registry=r
        )
        self.seq_gaps = Counter(
            "trainguard_ingest_seq_gaps",
            "Reports never received: jumps in an agent instance's sequence numbers",
            registry=r,
        )
        self.failed = Counter(
            "trainguard_ingest_failed_reports",
            "Reports answered 503 because the database did not commit",
            registry=r,
        )
        self.latency = Histogram(
            "trainguard_ingest_latency_seconds",
            "Time from request body received to reply (includes the group commit)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_reports = Histogram(
            "trainguard_ingest_batch_reports",
            "Reports per group-commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.commit_seconds = Histogram(
            "trainguard_ingest_commit_seconds",
            "Duration of one group-commit transaction",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        r.register(_StateCollector(state, db_commits, is_leader))

    def observe_batch(self, reports: int, seconds: float) -> None:
        """The group-commit writer's report after each commit."""
        if reports:
            self.batch_reports.observe(reports)
        self.commit_seconds.observe(seconds)


class SafeCollector(Collector):
    """A custom collector read at scrape time; its failure is logged, never the scrape's."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except Exception:  # a scrape must never fail because of us
            log.exception(
                "metrics collector failed", extra={"fields": {"collector": type(self).__name__}}
            )

    def _collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class _StateCollector(SafeCollector):
    def __init__(
        self, state: ClusterState, db_commits: Callable[[], int], is_leader: Callable[[], bool]
    ) -> None:
        self._state = state
        self._db_commits = db_commits
        self._is_leader = is_leader

    def _collect(self) -> Iterator[Metric]:
        state = self._state
        leader = GaugeMetricFamily(
            "trainguard_controller_leader",
            "1 on the replica that holds the leader lock and acts, 0 on a standby",
        )
        leader.add_metric([], 1.0 if self._is_leader() else 0.0)
        yield leader
        nodes = GaugeMetricFamily("trainguard_nodes", "Nodes by health", labels=["health"])
        for health, count in state.nodes_by_health().items():
            nodes.add_metric([health], count)
        yield nodes
        gpus = GaugeMetricFamily("trainguard_gpus", "GPUs by health", labels=["health"])
        by_health: dict[str, int] = {"healthy": 0, "unhealthy": 0, "lost": 0}
        for node in state.nodes.values():
            for gpu in node.gpus.values():
                by_health[gpu.health] = by_health.get(gpu.health, 0) + 1
        for health, count in by_health.items():
            gpus.add_metric([health], count)
        yield gpus
        incidents = GaugeMetricFamily(
            "trainguard_incidents_open", "Open incidents by kind", labels=["kind"]
        )
        for kind, count in sorted(state.incidents_open_by_kind().items()):
            incidents.add_metric([kind], count)
        yield incidents
        dropped = GaugeMetricFamily(
            "trainguard_agent_spool_dropped_reports",
            "Reports agents' bounded spools discarded, summed over nodes (as last reported)",
        )
        dropped.add_metric([], sum(n.spool_dropped_total for n in state.nodes.values()))
        yield dropped
        commits = CounterMetricFamily(
            "trainguard_db_commits", "Database transactions committed by this controller"
        )
        commits.add_metric([], self._db_commits())
        yield commits


class EventBusCollector(SafeCollector):
    """Per subscriber of the event bus: events handled, dropped (queue full) and queued."""

    def __init__(self, events: EventBus) -> None:
        self._events = events

    def _collect(self) -> Iterator[Metric]:
        labels = ["subscriber", "event"]
        delivered = CounterMetricFamily(
            "trainguard_events_delivered", "Events a subscriber has handled", labels=labels
        )
        dropped = CounterMetricFamily(
            "trainguard_events_dropped",
            "Events dropped for a subscriber whose queue was full (it was too slow)",
            labels=labels,
        )
        backlog = GaugeMetricFamily(
            "trainguard_events_backlog", "Events queued for a subscriber", labels=labels
        )
        for sub in self._events.subscriptions():
            key = [sub.name, sub.event_type.__name__]
            delivered.add_metric(key, sub.delivered)
            dropped.add_metric(key, sub.dropped)
            backlog.add_metric(key, sub.backlog)
        yield delivered
        yield dropped
        yield backlog
