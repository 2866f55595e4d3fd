"""Prometheus view of remediation: goodput per job, isolated nodes, remediations by outcome.

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
