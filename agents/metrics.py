"""Prometheus ``/metrics`` for the agent: GPU series with dcgm-exporter's label names.

A custom collector reads the latest sample at scrape time (no second polling loop, no
stale gauges to reset). Names carry base units (watts, joules, hertz, bytes, ratio) and
``_total`` on counters; NVML's mJ, MHz and percent are converted here.

Per-GPU labels are dcgm-exporter's: ``gpu``, ``UUID``, ``pci_bus_id``, ``device``
(``nvidia<N>``), ``modelName``, ``Hostname`` (the *node* name, stable across agent
rollouts, never the pod name), plus ``pod`` and ``namespace`` of the job using the GPU
when a rank told the agent (empty otherwise, which Prometheus treats as absent). So
Grafana panels written for dcgm-exporter can select our series by the same labels.

Cardinality is bounded and small (docs/agent.md counts it): throttle reasons are one
bitmask gauge per GPU (dcgm's ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``), not one series per
reason; NVLink errors are summed per GPU by type; ``xid`` only takes codes actually seen;
NIC counters come from a fixed list.
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
from agents.nics import ERROR_COUNTERS, port_is_up
from agents.stats import AgentStats
from trainguard.wire import GpuInfo, GpuSample, NodeSample

log = logging.getLogger(__name__)

_GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "pod", "namespace"]
_NIC_LABELS = ["device", "port", "Hostname"]
#: Congestion counters exported per port (RoCE ECN/CNP); errors come from ERROR_COUNTERS.
_CONGESTION_COUNTERS = ("np_cnp_sent", "np_ecn_marked_roce_packets", "rp_cnp_handled")
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
    #: Samples left out of a report to keep it under the wire's cap (agents.batch).
    samples_thinned_total: Callable[[], int] = lambda: 0
    #: XID and hardware events left out of reports by their per-report budgets
    #: (agents.batch; the node's own event counters count every one).
    xids_dropped_total: Callable[[], int] = lambda: 0
    hardware_events_dropped_total: Callable[[], int] = lambda: 0
    #: Command acks left out past their per-report budget (the controller resends).
    acks_dropped_total: Callable[[], int] = lambda: 0
    #: GPU index -> (pod, namespace) of the job using it, from the ranks' hellos.
    gpu_pods: Callable[[], dict[int, tuple[str, str]]] = dict
    latest: NodeSample | None = None


class AgentCollector(Collector):
    def __init__(self, source: MetricsSource) -> None:
        self._src = source

    def _labels(self, index: int, pods: dict[int, tuple[str, str]] | None = None) -> list[str]:
        inv = {g.index: g for g in self._src.inventory}.get(index)
        pod, namespace = (pods or {}).get(index, ("", ""))
        uuid, bus, name = (inv.uuid, inv.pci_bus_id, inv.name) if inv else ("", "", "")
        return [str(index), uuid, bus, f"nvidia{index}", name, self._src.hostname, pod, namespace]

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

        pods = self._src.gpu_pods()
        families = _GpuFamilies(gauge)
        for g in sample.gpus:
            families.add(self._labels(g.index, pods), g)
        xid = CounterMetricFamily(
            "trainguard_gpu_xid_errors",
            "XID events seen by this agent",
            labels=[*_GPU_LABELS, "xid"],
        )
        with self._src.stats._lock:
            xids = dict(self._src.stats.xid_total)
            hw_events = dict(self._src.stats.hardware_events_total)
        for (gpu, code), count in sorted(xids.items()):
            code_label = str(code) if 0 <= code < _MAX_XID_LABEL else "other"
            xid.add_metric([*self._labels(gpu, pods), code_label], float(count))
        node = GaugeMetricFamily(
            "trainguard_node_power_watts",
            "Node power (see source label)",
            labels=["Hostname", "source"],
        )
        if sample.node_power_w is not None:
            node.add_metric([self._src.hostname, sample.node_power_source], sample.node_power_w)
        events = CounterMetricFamily(
            "trainguard_node_hardware_events",
            "Hardware events seen (link flaps, NICs gone, errors rising, GPUs unknown)",
            labels=["Hostname", "kind"],
        )
        for kind, count in sorted(hw_events.items()):
            events.add_metric([self._src.hostname, kind], float(count))
        yield from (*families.all(), xid, node, events, *self._nic_metrics(sample))

    def _nic_metrics(self, sample: NodeSample) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "trainguard_nic_port_up",
            "1 when the RDMA port is ACTIVE (or ACTIVE_DEFER)",
            labels=_NIC_LABELS,
        )
        rate = GaugeMetricFamily(
            "trainguard_nic_port_rate_bits_per_second", "Link rate", labels=_NIC_LABELS
        )
        errors = CounterMetricFamily(
            "trainguard_nic_port_errors",
            "Port error counters (sysfs counters/ and hw_counters/)",
            labels=[*_NIC_LABELS, "counter"],
        )
        congestion = CounterMetricFamily(
            "trainguard_nic_port_congestion",
            "RoCE congestion notifications (CNP sent/handled, ECN marked)",
            labels=[*_NIC_LABELS, "counter"],
        )
        for port in sample.nics:
            labels = [port.device, str(port.port), self._src.hostname]
            up.add_metric(labels, 1.0 if port_is_up(port.state) else 0.0)
            _maybe(rate, labels, port.rate_gbps, 1e9)
            for name in (*ERROR_COUNTERS, "link_downed"):
                _maybe(errors, [*labels, name], port.counters.get(name))
            for name in _CONGESTION_COUNTERS:
                _maybe(congestion, [*labels, name], port.counters.get(name))
        yield from (up, rate, errors, congestion)

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
        thinned = CounterMetricFamily(
            "trainguard_agent_samples_thinned",
            "Older samples left out of a report to keep it under the size cap (thinned evenly)",
        )
        thinned.add_metric([], float(self._src.samples_thinned_total()))
        yield thinned
        # What the report budgets left out: a storm is folded, so the controller sees fewer
        # events than happened; these say how many fewer (the node's counters count all).
        for name, doc, read in (
            (
                "trainguard_agent_xids_dropped",
                "XID events left out of reports by the per-report XID budget",
                self._src.xids_dropped_total,
            ),
            (
                "trainguard_agent_hardware_events_dropped",
                "Hardware events folded or left out of reports by the per-report event budget",
                self._src.hardware_events_dropped_total,
            ),
            (
                "trainguard_agent_command_acks_dropped",
                "Command acks left out past the per-report ack budget (the controller resends)",
                self._src.acks_dropped_total,
            ),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(read()))
            yield family
        if stats.last_report_ok_unix_s is not None:
            yield GaugeMetricFamily(
                "trainguard_agent_last_report_success_timestamp_seconds",
                "When the controller last acknowledged a report (alert on its age)",
                value=stats.last_report_ok_unix_s,
            )


class _GpuFamilies:
    """Every per-GPU family, filled one GPU sample at a time."""

    def __init__(self, gauge: Callable[..., GaugeMetricFamily]) -> None:
        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*_GPU_LABELS, *extra])

        self.power = gauge("trainguard_gpu_power_watts", "GPU board power draw")
        self.energy = counter("trainguard_gpu_energy_joules", "GPU energy since driver load")
        self.temp = gauge("trainguard_gpu_temperature_celsius", "GPU core temperature")
        self.sm = gauge("trainguard_gpu_sm_clock_hertz", "SM clock")
        self.mem = gauge("trainguard_gpu_memory_clock_hertz", "Memory clock")
        self.util = gauge("trainguard_gpu_utilization_ratio", "GPU busy fraction (0-1)")
        self.used = gauge("trainguard_gpu_memory_used_bytes", "Framebuffer memory in use")
        self.limit = gauge("trainguard_gpu_power_limit_watts", "Enforced power limit")
        self.lost = gauge("trainguard_gpu_lost", "1 when NVML reports the GPU lost")
        self.unknown = gauge("trainguard_gpu_unknown", "1 when NVML did not answer in time")
        self.unreachable = gauge(
            "trainguard_gpu_unreachable", "1 when no NVML read has answered for several samples"
        )
        self.ecc = counter("trainguard_gpu_ecc_errors", "Volatile ECC errors", ["type"])
        self.ecc_aggregate = counter(
            "trainguard_gpu_ecc_aggregate_errors", "ECC errors over the board's life", ["type"]
        )
        self.reasons = gauge(
            "trainguard_gpu_clocks_event_reasons",
            "NVML clocks-event (throttle) reason bitmask (nvmlClocksEventReason* bits)",
        )
        self.remapped = counter("trainguard_gpu_remapped_rows", "Rows remapped by cause", ["type"])
        self.remap_pending = gauge(
            "trainguard_gpu_row_remap_pending", "1 when a remap waits for a GPU reset"
        )
        self.remap_failed = gauge("trainguard_gpu_row_remap_failed", "1 when a remap failed")
        self.retired = counter("trainguard_gpu_retired_pages", "Retired pages by cause", ["cause"])
        self.pcie_replays = counter("trainguard_gpu_pcie_replays", "PCIe replay counter")
        self.pcie_width = gauge("trainguard_gpu_pcie_link_width", "PCIe lanes in use")
        self.nvlink_errors = counter(
            "trainguard_gpu_nvlink_errors", "NVLink errors summed over links", ["type"]
        )
        self.nvlinks_down = gauge(
            "trainguard_gpu_nvlinks_down", "NVLinks that were up at start and are down now"
        )

    def add(self, labels: list[str], g: GpuSample) -> None:
        self.lost.add_metric(labels, 1.0 if g.lost else 0.0)
        self.unknown.add_metric(labels, 1.0 if g.unknown else 0.0)
        self.unreachable.add_metric(labels, 1.0 if g.unreachable else 0.0)
        _maybe(self.power, labels, g.power_w)
        _maybe(self.energy, labels, g.energy_j)
        _maybe(self.temp, labels, g.temperature_c)
        _maybe(self.sm, labels, g.sm_clock_mhz, 1e6)
        _maybe(self.mem, labels, g.mem_clock_mhz, 1e6)
        _maybe(self.util, labels, g.utilization_gpu_pct, 0.01)
        _maybe(self.used, labels, g.memory_used_bytes)
        _maybe(self.limit, labels, g.power_limit_w)
        _maybe(self.ecc, [*labels, "corrected"], g.ecc_corrected_total)
        _maybe(self.ecc, [*labels, "uncorrected"], g.ecc_uncorrected_total)
        _maybe(self.ecc_aggregate, [*labels, "corrected"], g.ecc_corrected_aggregate_total)
        _maybe(self.ecc_aggregate, [*labels, "uncorrected"], g.ecc_uncorrected_aggregate_total)
        if not (g.lost or g.unknown or g.unreachable):
            self.reasons.add_metric(labels, float(g.throttle_reasons_mask))
        _maybe(self.remapped, [*labels, "correctable"], g.remapped_rows_correctable)
        _maybe(self.remapped, [*labels, "uncorrectable"], g.remapped_rows_uncorrectable)
        _maybe(self.remap_pending, labels, g.row_remap_pending)
        _maybe(self.remap_failed, labels, g.row_remap_failed)
        _maybe(self.retired, [*labels, "sbe"], g.retired_pages_sbe)
        _maybe(self.retired, [*labels, "dbe"], g.retired_pages_dbe)
        _maybe(self.pcie_replays, labels, g.pcie_replay_total)
        _maybe(self.pcie_width, labels, g.pcie_link_width)
        _maybe(self.nvlink_errors, [*labels, "crc"], g.nvlink_crc_errors_total)
        _maybe(self.nvlink_errors, [*labels, "replay"], g.nvlink_replay_errors_total)
        _maybe(self.nvlink_errors, [*labels, "recovery"], g.nvlink_recovery_errors_total)
        if g.nvlink_active_count is not None:
            self.nvlinks_down.add_metric(labels, float(sum(not n.active for n in g.nvlinks)))

    def all(self) -> list[Metric]:
        return [v for v in vars(self).values() if isinstance(v, Metric)]


def _maybe(
    family: Any, labels: list[str], value: float | int | bool | None, scale: float = 1.0
) -> None:
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
