"""Prometheus view of remediation: goodput and checkpoint freshness per job, isolated nodes,
remediations by outcome.

Read from the engine at scrape time, like the controller's other gauges, so a dashboard
shows the same numbers as ``GET /api/v1/jobs/{name}/goodput`` and never a stale copy.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from controller.services.metrics import SafeCollector
from controller.services.remediation.engine import RemediationEngine


class RemediationCollector(SafeCollector):
    def __init__(self, engine: RemediationEngine) -> None:
        self._engine = engine

    def _collect(self) -> Iterator[Metric]:
        engine = self._engine
        ratio = GaugeMetricFamily(
            "trainguard_job_goodput_ratio",
            "Productive / wall time of a job since its first step (effective training time ratio)",
            labels=["job"],
        )
        lost = GaugeMetricFamily(
            "trainguard_job_lost_seconds",
            "Training time a job lost to incidents: outages and steps run again",
            labels=["job"],
        )
        for name, book in sorted(engine.jobs.items()):
            snap = book.ledger.snapshot()
            if snap.get("ettr") is not None:
                ratio.add_metric([name], float(snap["ettr"]))
            lost.add_metric([name], float(snap.get("lost_s") or 0.0))
        yield ratio
        yield lost
        yield from _checkpoint_metrics(engine)
        states: dict[str, int] = {"running": 0, "done": 0, "failed": 0}
        for rem in engine.remediations:
            states[rem.state] = states.get(rem.state, 0) + 1
        by_state = GaugeMetricFamily(
            "trainguard_remediations",
            "Remediations this leader ran (the newest 100), by state",
            labels=["state"],
        )
        for state, count in sorted(states.items()):
            by_state.add_metric([state], count)
        yield by_state
        isolated = GaugeMetricFamily(
            "trainguard_nodes_isolated", "Nodes the remediation engine keeps work off"
        )
        isolated.add_metric([], len(engine.isolated_nodes()))
        yield isolated


def _checkpoint_metrics(engine: RemediationEngine) -> Iterator[Metric]:
    """When each job last committed a checkpoint, its observed interval and its newest step:
    the PrometheusRule's TrainguardCheckpointsNotDurable compares the age of the commit with
    N intervals, for jobs still stepping (a finished job's old commit is no alarm)."""
    committed = GaugeMetricFamily(
        "trainguard_job_checkpoint_committed_timestamp_seconds",
        "Unix time of the job's newest committed (durable, all ranks) checkpoint",
        labels=["job"],
    )
    interval = GaugeMetricFamily(
        "trainguard_job_checkpoint_interval_seconds",
        "Seconds between the job's two newest committed checkpoints (its interval, as observed)",
        labels=["job"],
    )
    last_step = GaugeMetricFamily(
        "trainguard_job_last_step_timestamp_seconds",
        "Unix time the job's newest step (rank 0) ended",
        labels=["job"],
    )
    for name, book in sorted(engine.jobs.items()):
        if book.committed_unix_s is not None:
            committed.add_metric([name], book.committed_unix_s)
        if book.checkpoint_interval_s is not None:
            interval.add_metric([name], book.checkpoint_interval_s)
        if book.last_step_unix_s is not None:
            last_step.add_metric([name], book.last_step_unix_s)
    yield committed
    yield interval
    yield last_step
