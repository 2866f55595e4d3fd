"""Prometheus ``/metrics`` for the agent: GPU gauges in dcgm-exporter's label style.

A custom collector reads the latest sample at scrape time (no second polling loop, no
stale gauges to reset). Names carry base units (watts, joules, hertz, bytes, ratio) and
``_total`` on counters; NVML's mJ, MHz and percent are converted here. Label values are
bounded: per-GPU labels come from the inventory, ``reason`` from the fixed NVML bit list,
``xid`` from codes actually seen (a small set), ``type`` is corrected|uncorrected.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from agents.errors import ListenError
from agents.stats import AgentStats
from trainguard.wire import GpuInfo, NodeSample, ThrottleReason

log = logging.getLogger(__name__)

_GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "modelName", "hostname"]
#: XID codes are below ~200 today; anything odd is folded into one label value.
_MAX_XID_LABEL = 1000


@dataclass(slots=True)
class MetricsSource:
    """What the collector reads; the daemon updates ``latest`` after every sample."""

    hostname: str
    inventory: Sequence[GpuInfo]
    stats: AgentStats
    spool_stats: Callable[[], tuple[int, int]]
    spool_dropped_total: Callable[[], int]
    local_clients: Callable[[], int] = lambda: 0
    records_dropped_total: Callable[[], int] = lambda: 0
    latest: NodeSample | None = None


class AgentCollector(Collector):
    def __init__(self, source: MetricsSource) -> None:
        self._src = source

    def _labels(self, index: int) -> list[str]:
        inv = {g.index: g for g in self._src.inventory}.get(index)
        if inv is None:
            return [str(index), "", "", "", self._src.hostname]
        return [str(index), inv.uuid, inv.pci_bus_id, inv.name, self._src.hostname]

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._gpu_metrics()
        except Exception:  # metrics fail open: a bad sample must not break the scrape
            log.exception("metrics: GPU collector failed")
        yield from self._agent_metrics()

    def _gpu_metrics(self) -> Iterator[Metric]:
        sample = self._src.latest
        if sample is None:
            return

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*_GPU_LABELS, *extra])

        power = gauge("trainguard_gpu_power_watts", "GPU board power draw")
        energy = CounterMetricFamily(
            "trainguard_gpu_energy_joules", "GPU energy since driver load", labels=_GPU_LABELS
        )
        temp = gauge("trainguard_gpu_temperature_celsius", "GPU core temperature")
        sm = gauge("trainguard_gpu_sm_clock_hertz", "SM clock")
        mem = gauge("trainguard_gpu_memory_clock_hertz", "Memory clock")
        util = gauge("trainguard_gpu_utilization_ratio", "GPU busy fraction (0-1)")
        used = gauge("trainguard_gpu_memory_used_bytes", "Framebuffer memory in use")
        limit = gauge("trainguard_gpu_power_limit_watts", "Enforced power limit")
        lost = gauge("trainguard_gpu_lost", "1 when NVML reports the GPU lost")
        ecc = CounterMetricFamily(
            "trainguard_gpu_ecc_errors", "Volatile ECC errors", labels=[*_GPU_LABELS, "type"]
        )
        throttle = gauge(
            "trainguard_gpu_throttle_reason", "1 when the clock-event reason is active", ["reason"]
        )
        for g in sample.gpus:
            labels = self._labels(g.index)
            lost.add_metric(labels, 1.0 if g.lost else 0.0)
            _maybe(power, labels, g.power_w)
            _maybe(energy, labels, g.energy_j)
            _maybe(temp, labels, g.temperature_c)
            _maybe(sm, labels, g.sm_clock_mhz, 1e6)
            _maybe(mem, labels, g.mem_clock_mhz, 1e6)
            _maybe(util, labels, g.utilization_gpu_pct, 0.01)
            _maybe(used, labels, g.memory_used_bytes)
            _maybe(limit, labels, g.power_limit_w)
            _maybe(ecc, [*labels, "corrected"], g.ecc_corrected_total)
            _maybe(ecc, [*labels, "uncorrected"], g.ecc_uncorrected_total)
            if not g.lost:
                active = set(g.throttle_reasons)
                for reason in ThrottleReason:
                    throttle.add_metric([*labels, reason.value], 1.0 if reason in active else 0.0)
        xid = CounterMetricFamily(
            "trainguard_gpu_xid_errors",
            "XID events seen by this agent",
            labels=[*_GPU_LABELS, "xid"],
        )
        with self._src.stats._lock:
            xids = dict(self._src.stats.xid_total)
        for (gpu, code), count in sorted(xids.items()):
            code_label = str(code) if 0 <= code < _MAX_XID_LABEL else "other"
            xid.add_metric([*self._labels(gpu), code_label], float(count))
        node = GaugeMetricFamily(
            "trainguard_node_power_watts",
            "Node power (see source label)",
            labels=["hostname", "source"],
        )
        if sample.node_power_w is not None:
            node.add_metric([self._src.hostname, sample.node_power_source], sample.node_power_w)
        yield from (power, energy, temp, sm, mem, util, used, limit, lost, ecc, throttle, xid, node)

    def _agent_metrics(self) -> Iterator[Metric]:
        stats = self._src.stats
        for name, doc, value in (
            (
                "trainguard_agent_reports_sent",
                "Reports the controller acknowledged",
                stats.reports_sent_total,
            ),
            (
                "trainguard_agent_report_failures",
                "Failed delivery attempts",
                stats.report_failures_total,
            ),
            (
                "trainguard_agent_reports_rejected",
                "Reports the controller refused (4xx)",
                stats.reports_rejected_total,
            ),
            (
                "trainguard_agent_spool_dropped",
                "Reports dropped because the spool was full",
                self._src.spool_dropped_total(),
            ),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(value))
            yield counter
        reports, size = self._src.spool_stats()
        yield GaugeMetricFamily(
            "trainguard_agent_spool_reports", "Reports waiting in the spool", value=reports
        )
        yield GaugeMetricFamily(
            "trainguard_agent_spool_bytes", "Bytes waiting in the spool", value=size
        )
        yield GaugeMetricFamily(
            "trainguard_agent_local_clients",
            "Job-side clients connected to the local socket",
            value=self._src.local_clients(),
        )
        dropped = CounterMetricFamily(
            "trainguard_agent_records_dropped", "Job records dropped because a batch was full"
        )
        dropped.add_metric([], float(self._src.records_dropped_total()))
        yield dropped
        if stats.last_report_ok_unix_s is not None:
            yield GaugeMetricFamily(
                "trainguard_agent_last_report_success_timestamp_seconds",
                "When the controller last acknowledged a report (alert on its age)",
                value=stats.last_report_ok_unix_s,
            )


def _maybe(family: Any, labels: list[str], value: float | int | None, scale: float = 1.0) -> None:
    if value is not None:
        family.add_metric(labels, float(value) * scale)


class MetricsServer:
    """The agent's own registry on its own HTTP port (never the process-global one)."""

    def __init__(self, source: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(source))
        self._httpd: WSGIServer | None = None

    def start(self, host: str, port: int) -> int:
        try:
            httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ListenError(
                f"metrics on {host}:{port}: {exc.strerror or exc}; set metrics_port to a free "
                "port, 0 for an ephemeral one, or -1 to disable"
            ) from None
        self._httpd = httpd
        bound = int(httpd.server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


def hostname() -> str:
    return socket.gethostname()


__all__ = ["AgentCollector", "MetricsServer", "MetricsSource", "hostname"]
