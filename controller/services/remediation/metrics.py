"""Prometheus view of remediation: goodput and checkpoint freshness per job, isolated nodes,
remediations by outcome.

Read from the engine at scrape time, like the controller's other gauges, so a dashboard
shows the same numbers as ``GET /api/v1/jobs/{name}/goodput`` and never a stale copy.

Job names come from what agents report, so the per-job series are bounded: only jobs the
controller heard from (any record of theirs, by the controller's clock) within
``JOB_SERIES_IDLE_S`` are exported, at most ``MAX_JOB_SERIES`` of them, the most recently
heard first. A finished job's series go away an hour after its last record (Prometheus
marks them stale) instead of staying for the life of the process, and a stream of made-up
job names cannot grow the exposition without bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from controller.services.metrics import SafeCollector
from controller.services.remediation.engine import RemediationEngine
from controller.services.remediation.records import JobBook

#: Seconds after a job's last record (controller time) that its series are still exported.
JOB_SERIES_IDLE_S = 3600.0
#: Most jobs with series at once (the most recently heard from).
MAX_JOB_SERIES = 500


class RemediationCollector(SafeCollector):
    def __init__(self, engine: RemediationEngine) -> None:
        self._engine = engine

    def _collect(self) -> Iterator[Metric]:
        engine = self._engine
        ratio = GaugeMetricFamily(
            "trainguard_job_goodput_ratio",
            "Productive / wall time of a job since its first step (effective training time ratio)",
            labels=["job_name"],
        )
        lost = GaugeMetricFamily(
            "trainguard_job_lost_seconds",
            "Training time a job lost to incidents: outages and steps run again",
            labels=["job_name"],
        )
        jobs = exported_jobs(engine, time.time())
        for name, book in jobs:
            snap = book.ledger.snapshot()
            if snap.get("ettr") is not None:
                ratio.add_metric([name], float(snap["ettr"]))
            lost.add_metric([name], float(snap.get("lost_s") or 0.0))
        yield ratio
        yield lost
        yield from _checkpoint_metrics(jobs)
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


def exported_jobs(engine: RemediationEngine, now: float) -> list[tuple[str, JobBook]]:
    """The jobs whose series are exported, by name: heard from within ``JOB_SERIES_IDLE_S``
    (a job the state does not know is left out), the newest ``MAX_JOB_SERIES``."""
    seen: list[tuple[float, str, JobBook]] = []
    known = engine.ctx.state.jobs
    for name, book in engine.jobs.items():
        job = known.get(name)
        if job is not None and now - job.last_seen_unix_s <= JOB_SERIES_IDLE_S:
            seen.append((job.last_seen_unix_s, name, book))
    seen.sort(key=lambda item: item[0], reverse=True)
    return sorted(((name, book) for _, name, book in seen[:MAX_JOB_SERIES]), key=lambda j: j[0])


def _checkpoint_metrics(jobs: list[tuple[str, JobBook]]) -> Iterator[Metric]:
    """When each job last committed a checkpoint, its observed interval and its newest step:
    the PrometheusRule's TrainguardCheckpointsNotDurable compares the age of the commit with
    N intervals, for jobs still stepping (a finished job's old commit is no alarm)."""
    committed = GaugeMetricFamily(
        "trainguard_job_checkpoint_committed_timestamp_seconds",
        "Unix time of the job's newest committed (durable, all ranks) checkpoint",
        labels=["job_name"],
    )
    interval = GaugeMetricFamily(
        "trainguard_job_checkpoint_interval_seconds",
        "Seconds between the job's two newest committed checkpoints (its interval, as observed)",
        labels=["job_name"],
    )
    last_step = GaugeMetricFamily(
        "trainguard_job_last_step_timestamp_seconds",
        "Unix time the job's newest step (rank 0) ended",
        labels=["job_name"],
    )
    for name, book in jobs:
        if book.committed_unix_s is not None:
            committed.add_metric([name], book.committed_unix_s)
        if book.checkpoint_interval_s is not None:
            interval.add_metric([name], book.checkpoint_interval_s)
        if book.last_step_unix_s is not None:
            last_step.add_metric([name], book.last_step_unix_s)
    yield committed
    yield interval
    yield last_step
