"""The node agent daemon: wires sampler, spool, reporter, local socket, metrics, commands.

Threads::

    main        sample every sample_interval_s; every report_interval_s (sooner once a
                local rank has job_flush_steps new step summaries, at once after an XID,
                a lost GPU, a rank exit or an in-flight collective) seal the batch into a
                spooled report
    reporter    send spooled reports oldest first; run the reply's commands
    preflight-load  a preflight's clocks_load check: GPU load processes and their NVML
                reads, acked when done (the reporter's heartbeat goes on meanwhile)
    xid-watcher block in nvmlEventSetWait_v2 for critical XIDs
    nvml-gpuN   one per GPU: that GPU's NVML reads, so a hung call costs only that GPU
    local-*     one per job-side client on the Unix socket
    metrics     prometheus_client's HTTP server

A failing tick is logged and the loop goes on; shutdown seals what is pending into the
spool, so a clean stop loses nothing and a crash loses nothing either (see agents.batch).
Within a tick each reader (node power, RDMA ports, bonds, the NIC inventory) is a part of
its own: one that fails, or hands back a field the wire refuses, costs that part of the
sample (logged once per kind of trouble), never the GPU samples.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pynvml
from pydantic import ValidationError

import trainguard
from agents.batch import Batch, fold_events, min_report_cap_bytes, report_size, wire_cap
from agents.cadence import ReportCadence
from agents.clocks_load import ClocksLoadRunner, LoadSettings, load_command, run_preflight
from agents.commands import CommandExecutor, Finish
from agents.errors import AgentConfigError, GpuWatchError
from agents.gpu.backend import (
    GpuBackend,
    next_retry_delay_s,
    open_backend,
    retry_nvml,
)
from agents.gpu.fault_file import FaultFile
from agents.gpu.sim import SimNvml
from agents.local_endpoint import LocalEndpoint, Session
from agents.metrics import MetricsServer, MetricsSource
from agents.nics import NicMonitor
from agents.node_power import NodePowerSampler, RaplReader, Source
from agents.peer_groups import PeerGroupCache
from agents.preflight import Check, summary
from agents.reporter import BackoffPolicy, InvalidTokenError, Reporter, read_token_file
from agents.sampler import GpuSampler
from agents.settings import AgentSettings
from agents.spool import Spool
from agents.stats import AgentStats
from agents.tcp_endpoint import JobTokens
from agents.xid_events import EccEvent, XidWatcher
from trainguard import wire
from trainguard.wire import (
    BondSample,
    CommandAck,
    HardwareEvent,
    JobCommand,
    JobRecords,
    NicInfo,
    NicPortSample,
    NodeIdentity,
    NodeSample,
    Report,
    ReportReply,
    RunPreflight,
    XidEvent,
)

log = logging.getLogger(__name__)

#: Urgent reports are at least this far apart, so an XID storm is one report, not hundreds.
MIN_URGENT_GAP_S = 0.25
#: On shutdown, how long the reporter may keep sending what is spooled.
SHUTDOWN_DRAIN_S = 2.0
#: NVML that failed at start is retried after this delay, doubling up to the cap: a node whose
#: driver comes back (module reloaded, upgrade finished) recovers without an agent restart.
NVML_RETRY_FIRST_S = 5.0
NVML_RETRY_MAX_S = 300.0
#: Hardware events that are sent at once rather than at the next report interval.
URGENT_EVENTS = frozenset(
    {
        "gpu_unknown",
        "gpu_unreachable",
        "nvlink_down",
        "nic_port_down",
        "nic_gone",
        "bond_member_down",
    }
)
#: List caps of a node sample and of the identity's NIC list, from the wire models: a node
#: with more ports or bonds than the wire takes reports the first ones, not nothing.
_MAX_PORTS = wire_cap(NodeSample, "nics")
_MAX_BONDS = wire_cap(NodeSample, "bonds")
_MAX_EVENTS = wire_cap(NodeSample, "events")
_MAX_NIC_INFOS = wire_cap(NodeIdentity, "nics")
#: NodeSample fields a tick can do without, and what stands in when the wire refuses them.
_OPTIONAL_FIELDS: dict[str, object] = {
    "node_power_w": None,
    "node_power_source": "none",
    "nics": [],
    "bonds": [],
    "events": [],
}

_T = TypeVar("_T")


class Agent:
    """One agent; ``start()``, then ``run_until(stop_event)``, then ``stop()``."""

    def __init__(self, settings: AgentSettings, *, backend: GpuBackend | None = None) -> None:
        if not settings.controller_url:
            raise AgentConfigError(
                "controller_url is required (--controller URL or TRAINGUARD_AGENT_CONTROLLER_URL)"
            )
        self.controller_url: str = settings.controller_url
        self.settings = settings
        self.stats = AgentStats()
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._stopping = threading.Event()
        self._last_urgent = 0.0
        #: Parts of a tick in trouble -> the trouble last logged (one line per kind).
        self._part_trouble: dict[str, str] = {}
        path = settings.sim_fault_file
        self._fault_file = FaultFile(path) if path is not None else None
        if self._fault_file is not None:
            self._fault_file.check()
        self.backend = backend or open_backend(
            settings.gpus,
            fault_specs=settings.sim_faults,
            seed=settings.sim_seed,
            sim_no_permission=settings.sim_no_permission,
            identity=settings.node_name,
            dev_dir=settings.dev_dir,
        )
        #: Retry schedule while ``backend.error`` (NVML failed although GPUs are present).
        self.nvml_retry_first_s = NVML_RETRY_FIRST_S
        self.nvml_retry_max_s = NVML_RETRY_MAX_S
        self.nvml_retries = 0
        self._next_nvml_retry: float | None = None
        try:
            self._build(settings)
        except BaseException:
            self.backend.shutdown()
            raise

    def _build(self, settings: AgentSettings) -> None:
        self.spool = Spool(settings.resolved_spool_dir, max_bytes=settings.spool_max_bytes)
        self.batch = Batch(
            self.spool.journal_dir,
            next_seq=self.spool.next_seq,
            quarantine_dir=self.spool.quarantine_dir,
            # A report the spool cannot hold is set aside, never sent: the smaller bound wins.
            max_report_bytes=min(wire.MAX_REPORT_BYTES, settings.spool_max_bytes),
        )
        #: The samples asked for an early report (logged the first time only).
        self._early_for_size = False
        self.cadence = ReportCadence(
            report_interval_s=settings.report_interval_s,
            job_flush_steps=settings.job_flush_steps,
            job_flush_min_interval_s=settings.job_flush_min_interval_s,
            last_report_s=time.monotonic(),
        )
        self.peer_groups = PeerGroupCache()
        self.endpoint: LocalEndpoint | None = None
        if settings.socket_path or settings.job_listen:
            self.endpoint = LocalEndpoint(
                Path(settings.socket_path) if settings.socket_path else None,
                on_records=self._on_records,
                tcp=settings.job_tcp(),
                idle_timeout_s=settings.client_idle_timeout_s,
                # Read at each hello: the sampler (and its inventory) may be replaced later.
                gpu_inventory=lambda: self.sampler.inventory,
            )
        self.xids: XidWatcher | None = None
        #: The watcher whose death is in the report's ``gpu_error`` (said once).
        self._xid_failure_reported: XidWatcher | None = None
        #: The XID wait failure last reported ("" none): a change asks for a report now.
        self._xid_wait_failure = ""
        self.executor: CommandExecutor | None = None
        self.sampler = self._new_sampler(self.backend.api)
        # A driver that cannot count its GPUs came back from open_backend as a failed one
        # (backend.error, NoGpus): this count is then zero.
        inventory = self.sampler.open()
        api = self.backend.api
        self._inventory_version = self.sampler.inventory_version
        self.nics = NicMonitor(settings.sysfs_root)
        self.clocks_load = ClocksLoadRunner()
        self.executor = CommandExecutor(
            api,
            self.sampler.handles,
            relay=self._relay,
            on_ack=self._on_ack,
            preflight=self._preflight,
        )
        self.xids = XidWatcher(
            api,
            self.sampler.handles,
            on_event=self._on_xid,
            on_ecc=self._on_ecc,
            report_after_s=settings.xid_wait_failing_s,
        )
        self.node_power = NodePowerSampler(
            RaplReader(settings.powercap_dir), base_power_w=settings.node_base_power_w
        )
        self.identity = NodeIdentity(
            name=settings.node_name,
            hostname=socket.gethostname()[:253],
            labels=settings.labels,
            gpus=inventory,
            agent_version=trainguard.__version__,
            backend=self.backend.kind,
            driver_version=self.backend.driver_version[:64],
            gpu_error=self.backend.error,
            nics=self._nic_inventory(),
        )
        self._check_spool_fits_a_report(settings.spool_max_bytes)
        token = settings.token.get_secret_value() if settings.token else None
        self.reporter = Reporter(
            self.spool,
            controller_url=self.controller_url,
            token=token,
            token_file=settings.token_file,
            stats=self.stats,
            on_reply=self._on_reply,
            timeout_s=settings.report_timeout_s,
            backoff=BackoffPolicy(max_s=settings.backoff_max_s),
            on_invalid_command=self.executor.refuse,
        )
        self.metrics: MetricsServer | None = None
        self.metrics_source = MetricsSource(
            hostname=settings.node_name,
            inventory=inventory,
            stats=self.stats,
            spool_stats=self.spool.stats,
            spool_dropped_total=lambda: self.spool.state.dropped_total,
            local_clients=self._local_clients,
            records_dropped_total=lambda: self.batch.dropped_records_total,
            samples_thinned_total=lambda: self.batch.thinned_samples_total,
            xids_dropped_total=lambda: self.batch.dropped_xids_total,
            hardware_events_dropped_total=lambda: self.batch.dropped_events_total,
            acks_dropped_total=lambda: self.batch.dropped_acks_total,
            gpu_pods=self._gpu_pods,
        )
        self.metrics_port: int | None = None

    def _check_spool_fits_a_report(self, spool_max_bytes: int) -> None:
        """Refuse to start when the spool cannot hold one report of this node: every report
        would be set aside as larger than the spool (``rejected/``), the node's data lost
        with only ``spool_dropped_total`` saying so (a 64-GPU node with the 64 KiB minimum)."""
        need = min_report_cap_bytes(
            report_size(self.identity), gpus=len(self.identity.gpus), ports=len(self.identity.nics)
        )
        if spool_max_bytes < need:
            raise AgentConfigError(
                f"spool_max_bytes={spool_max_bytes} cannot hold one report of this node "
                f"({len(self.identity.gpus)} GPU(s), {len(self.identity.nics)} RDMA port(s)): "
                f"every report would be set aside unsent; set spool_max_bytes "
                f"(TRAINGUARD_AGENT_SPOOL_MAX_BYTES, --spool-max-bytes) to at least {need}"
            )

    def _new_sampler(self, api: Any) -> GpuSampler:
        return GpuSampler(
            api,
            xid_source=self._drain_xids,
            locked_clock_mhz=lambda i: self.executor.locked_clock_mhz(i) if self.executor else None,
            on_lost=lambda i: self.request_report(f"GPU {i} lost"),
            timeout_s=self.settings.nvml_timeout_s,
            unreachable_after=self.settings.gpu_unreachable_after,
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        assert self.xids is not None
        if self.identity.gpus:
            self.xids.start_in_background()
        if self.endpoint is not None:
            self.endpoint.start()
        if self.settings.metrics_port >= 0:
            self.metrics = MetricsServer(self.metrics_source)
            self.metrics_port = self.metrics.start(
                self.settings.metrics_host, self.settings.metrics_port
            )
        self.reporter.start()
        waiting, _ = self.spool.stats()
        log.info(
            "agent %s up: %d %s GPU(s), instance %s, next seq %d, %d report(s) spooled",
            self.settings.node_name,
            len(self.identity.gpus),
            self.backend.kind,
            self.spool.agent_instance,
            self.spool.next_seq,
            waiting,
        )

    def stop(self) -> None:
        """Seal what is pending into the spool, give the reporter a moment, release all."""
        self._stopping.set()
        self.clocks_load.stop()  # kills a running load; its preflight acks before the flush
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.xids is not None:
            self.xids.stop()
        try:
            self.flush()
        except Exception:
            log.exception("final flush failed; the journal keeps the data for the next start")
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        self.reporter.wake()
        while self.spool.stats()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.reporter.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.batch.close()
        self.sampler.close()
        self.backend.shutdown()
        log.info("agent stopped; %d report(s) left in the spool", self.spool.stats()[0])

    def request_report(self, why: str) -> None:
        """Report at once (rate-limited), e.g. after a fatal-looking event."""
        log.info("urgent report: %s", why)
        self._urgent.set()
        self._wake.set()

    # ------------------------------------------------------------------ ticks

    def sample(self) -> NodeSample:
        if self._fault_file is not None and isinstance(self.backend.api, SimNvml):
            self._part("simulated faults", self._inject_faults, None)
        gpus = self.sampler.sample()
        self._check_xid_watcher()
        if self.sampler.inventory_version != self._inventory_version:
            # A GPU that hung at start answered: its real identity replaces the placeholder.
            self._inventory_version = self.sampler.inventory_version
            inventory = self.sampler.inventory
            self.identity = self.identity.model_copy(
                update={"gpus": inventory, "nics": self._nic_inventory()}
            )
            self.metrics_source.inventory = inventory
            if self.executor is not None:
                self.executor.update_handles(self.sampler.handles)
            if self.xids is not None:
                self.xids.update_handles(self.sampler.handles)
        now = time.time()
        # Each reader below is a part of its own: one that fails costs its fields only.
        no_power: tuple[float | None, Source] = (None, "none")
        power_w, source = self._part(
            "node power", lambda: self.node_power.node_power(gpus), no_power
        )
        no_ports: tuple[list[NicPortSample], list[HardwareEvent]] = ([], [])
        nics, nic_events = self._part("RDMA ports", lambda: self.nics.sample(now), no_ports)
        no_bonds: tuple[list[BondSample], list[HardwareEvent]] = ([], [])
        bonds, bond_events = self._part("bonds", lambda: self.nics.bonds(now), no_bonds)
        events = [*self.sampler.take_events(), *nic_events, *bond_events]
        if any(e.kind in ("nic_gone", "nic_back") for e in nic_events):
            # The report's inventory follows the cards actually present.
            self.identity = self.identity.model_copy(update={"nics": self._nic_inventory()})
        sample = self._node_sample(
            time_unix_s=now,
            gpus=gpus,
            node_power_w=power_w,
            node_power_source=source,
            nics=nics[:_MAX_PORTS],
            bonds=bonds[:_MAX_BONDS],
            # Folded, not cut: the GPU events come first in the list, and cutting its
            # head let 4,096 NIC events push a GPU's loss out of the sample.
            events=fold_events(events, max_count=_MAX_EVENTS),
        )
        if events:
            self.stats.count_events([e.kind for e in events])
        urgent = [e for e in events if e.kind in URGENT_EVENTS]
        if urgent:
            self.request_report(f"{urgent[0].kind}: {urgent[0].detail}")
        if self.batch.add_sample(sample):
            self._report_early_for_size()
        self.metrics_source.latest = sample
        return sample

    def _report_early_for_size(self) -> None:
        """The samples passed the batch's flush size (a big node, a long report interval):
        report now rather than let the report pass the wire's cap and be refused whole."""
        if not self._early_for_size:
            self._early_for_size = True
            log.info(
                "the samples since the last report pass %d bytes: reporting early, before "
                "report_interval_s (%gs), whenever they do (not logged again)",
                self.batch.sample_flush_bytes,
                self.settings.report_interval_s,
            )
        self._urgent.set()
        self._wake.set()

    def _inject_faults(self) -> None:
        api = self.backend.api
        assert self._fault_file is not None and isinstance(api, SimNvml)
        for fault in self._fault_file.poll(gpu_count=api.gpu_count):
            due = api.inject(fault)
            log.warning("simulated fault injected: %s", due.to_spec())

    def _part(self, what: str, read: Callable[[], _T], fallback: _T) -> _T:
        """``read()``, or ``fallback`` when it fails: one part of a tick (a sysfs reader, say)
        must never sink the rest of the sample. Logged with its traceback once per kind of
        trouble, and once more when the part works again."""
        try:
            value = read()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if self._part_trouble.get(what) != problem:
                self._part_trouble[what] = problem
                log.warning(
                    "%s unreadable this tick (%s); the sample goes out without it",
                    what,
                    problem,
                    exc_info=True,
                )
            return fallback
        if self._part_trouble.pop(what, None) is not None:
            log.info("%s readable again", what)
        return value

    def _node_sample(self, **fields: Any) -> NodeSample:
        """The tick's :class:`NodeSample`. A field the wire refuses (a negative node power
        from a misread counter, say) is replaced by its empty default, so the GPU samples
        still go out; only a sample whose GPUs or time are refused fails the tick."""
        try:
            return NodeSample(**fields)
        except ValidationError as exc:
            refused = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
            if not refused or not refused <= _OPTIONAL_FIELDS.keys():
                raise
            if "node_power_w" in refused or "node_power_source" in refused:
                refused |= {"node_power_w", "node_power_source"}
            problem = f"{', '.join(sorted(refused))}: {str(exc).splitlines()[0]}"
            if self._part_trouble.get("sample fields") != problem:
                self._part_trouble["sample fields"] = problem
                log.warning("the wire refuses %s; the sample goes out without it", problem)
            return NodeSample(**{**fields, **{k: _OPTIONAL_FIELDS[k] for k in refused}})

    def flush(self) -> int:
        """Seal the batch into the next spooled report; returns its seq."""
        with self.batch.lock:
            contents = self.batch.peek()

            def build(seq: int, dropped_total: int) -> Report:
                return Report(
                    node=self._reported_identity(),
                    agent_instance=self.spool.agent_instance,
                    seq=seq,
                    sent_unix_s=time.time(),
                    sample_interval_s=self.settings.sample_interval_s,
                    samples=contents.samples,
                    job=contents.records,
                    command_acks=contents.acks,
                    spool_dropped_total=dropped_total,
                )

            seq = self.spool.append(build)
            self.batch.reset(self.spool.next_seq)
            self.cadence.sealed()
        self.reporter.wake()
        return seq

    def run_until(self, stop: threading.Event) -> None:
        """The main loop; returns when ``stop`` is set."""
        s = self.settings
        next_sample = time.monotonic()
        self.cadence.last_report_s = next_sample

        def wake_on_stop() -> None:
            stop.wait()
            self._wake.set()

        stop_watcher = threading.Thread(target=wake_on_stop, name="stop-watch", daemon=True)
        stop_watcher.start()
        while not stop.is_set():
            now = time.monotonic()
            if self.backend.error:
                self._guarded("NVML retry", functools.partial(self._maybe_retry_nvml, now))
            urgent = self._urgent.is_set() and now - self._last_urgent >= MIN_URGENT_GAP_S
            if now >= next_sample or urgent:
                self._guarded("sample", self.sample)
                next_sample = max(next_sample + s.sample_interval_s, now + s.sample_interval_s / 2)
            if now >= self.cadence.due_s() or urgent:
                if urgent:
                    self._urgent.clear()
                    self._last_urgent = now
                self._guarded("report", self.flush)
                self.cadence.last_report_s = now  # restarted even if sealing failed
            self._wake.clear()
            timeout = min(next_sample, self.cadence.due_s()) - time.monotonic()
            if self._urgent.is_set():
                timeout = min(timeout, self._last_urgent + MIN_URGENT_GAP_S - time.monotonic())
            if timeout > 0:
                self._wake.wait(timeout)

    def _maybe_retry_nvml(self, now: float) -> bool:
        """Retry ``nvmlInit`` when due (capped exponential backoff); True once adopted."""
        if self._next_nvml_retry is None:
            self._next_nvml_retry = now + next_retry_delay_s(
                0, first_s=self.nvml_retry_first_s, max_s=self.nvml_retry_max_s
            )
        if now < self._next_nvml_retry:
            return False
        self.nvml_retries += 1
        backend = retry_nvml(self.backend)
        if backend is None or not self._adopt_backend(backend):
            self._next_nvml_retry = now + next_retry_delay_s(
                self.nvml_retries, first_s=self.nvml_retry_first_s, max_s=self.nvml_retry_max_s
            )
            return False
        return True

    def _adopt_backend(self, backend: GpuBackend) -> bool:
        """NVML answers now: watch its GPUs as if they had been there at start (sampler,
        commands, XID events, the report's identity); the next report clears ``gpu_error``.
        False (the backend released) while the GPUs still cannot be counted."""
        old_sampler = self.sampler
        sampler = self._new_sampler(backend.api)
        try:
            inventory = sampler.open()
        except pynvml.NVMLError as exc:
            log.debug("nvmlDeviceGetCount still fails: %s", exc)
            backend.shutdown()
            return False
        self.backend, self.sampler = backend, sampler
        self._inventory_version = sampler.inventory_version
        old_sampler.close()
        if self.executor is not None:
            self.executor.adopt_api(backend.api, sampler.handles)
        if self.xids is not None:
            self.xids.stop()
        self.xids = XidWatcher(
            backend.api,
            sampler.handles,
            on_event=self._on_xid,
            on_ecc=self._on_ecc,
            report_after_s=self.settings.xid_wait_failing_s,
        )
        if inventory and not self._stopping.is_set():
            self.xids.start_in_background()
        self.identity = self.identity.model_copy(
            update={
                "gpus": inventory,
                "driver_version": backend.driver_version[:64],
                "gpu_error": "",
                "nics": self._nic_inventory(),
            }
        )
        self.metrics_source.inventory = inventory
        log.warning(
            "NVML answers again after %d retr%s: watching %d GPU(s), driver %s",
            self.nvml_retries,
            "y" if self.nvml_retries == 1 else "ies",
            len(inventory),
            backend.driver_version or "?",
        )
        self.request_report("NVML recovered")
        return True

    def _guarded(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s tick failed; continuing", what)

    def _reported_identity(self) -> NodeIdentity:
        """The identity a report carries: with a standing XID wait failure in its
        ``gpu_error`` (unlike a dead watcher's, it goes once a wait works again)."""
        failing = self.xids.wait_failure if self.xids is not None else ""
        if not failing:
            return self.identity
        joined = "; ".join(e for e in (self.identity.gpu_error, failing) if e)
        return self.identity.model_copy(update={"gpu_error": joined[:512]})

    def _check_xid_watcher(self) -> None:
        """A watcher thread that ended on its own leaves XIDs unseen: the node says so, as
        it does (until it clears) for a watcher whose waits keep failing."""
        xids = self.xids
        failing = xids.wait_failure if xids is not None else ""
        if failing != self._xid_wait_failure and not self._stopping.is_set():
            self._xid_wait_failure = failing
            self.request_report("XID event wait " + ("failing" if failing else "works again"))
        if xids is None or not xids.failure or self._stopping.is_set():
            return
        if xids is self._xid_failure_reported:
            return
        self._xid_failure_reported = xids
        error = f"{xids.failure}; XIDs are not watched until the agent restarts"
        log.error("%s; reporting this node unhealthy", error)
        joined = "; ".join(e for e in (self.identity.gpu_error, error) if e)
        self.identity = self.identity.model_copy(update={"gpu_error": joined[:512]})
        self.request_report("XID watcher stopped")

    # ------------------------------------------------------------------ callbacks

    def _drain_xids(self, index: int) -> list[XidEvent]:
        """GPU ``index``'s XIDs for the next sample, as many as the report's XID budget
        leaves room for (a storm on every GPU of a big node must not pass the wire's cap)."""
        if self.xids is None:
            return []
        return self.xids.drain(index, self.batch.xid_limit(len(self.sampler.handles)))

    def _on_xid(self, event: XidEvent) -> None:
        if event.gpu_index is not None:
            self.stats.count_xid(event.gpu_index, event.code)
        self.request_report(f"XID {event.code} on GPU {event.gpu_index}")

    def _on_ecc(self, event: EccEvent) -> None:
        # An uncorrectable error is a fault the controller must see now, not at the next
        # report; corrected ones only move counters the next sample carries anyway.
        if event.uncorrectable:
            self.request_report(f"uncorrectable ECC error on GPU {event.gpu_index}")

    def _on_records(self, session: Session, records: JobRecords, size_bytes: int) -> None:
        self.peer_groups.remember(records)
        with self.batch.lock:  # the batch and its pending-step counts change together
            full = self.batch.add_records(records, size_bytes)
            before = self.cadence.most_pending_steps
            self.cadence.add(records)
            after = self.cadence.most_pending_steps
        flush_steps = self.settings.job_flush_steps
        if flush_steps and before < flush_steps <= after:
            self._wake.set()  # the early flush for step summaries may be due
        exited = [e for e in records.rank_events if e.kind == "exited"]
        if exited:
            self.request_report(f"rank {exited[0].rank} of job {exited[0].job} exited")
        elif records.inflight:
            self.request_report(f"in-flight collective reported by job {records.inflight[0].job}")
        elif full:
            self.request_report("job records batch is large")

    def _local_clients(self) -> int:
        if self.endpoint is None:
            return 0
        return sum(1 for s in self.endpoint.sessions() if s.disconnected_unix_s is None)

    def _preflight(self, cmd: RunPreflight, finish: Finish) -> None:
        """The controller asked for a preflight: check the latest sample and the NICs now,
        then load the GPUs (``clocks_load``) on the ``preflight-load`` thread where the agent
        can; ``finish`` acks, at once or when the load is over."""
        latest = self.metrics_source.latest
        if latest is None and self.identity.gpus:
            finish(False, "preflight: no GPU sample taken yet; ask again in a second")
            return
        executor = self.executor
        load, why_not = self._load_settings()

        def verdict(final: list[Check]) -> None:
            finish(all(c.status != "fail" for c in final), summary(final))

        run_preflight(
            self.backend,
            self.sampler,
            self.nics,
            latest.gpus if latest is not None else [],
            load=load,
            why_not=why_not,
            done=verdict,
            start=self.clocks_load.start,
            expected_nic_rate_gbps=cmd.expected_nic_rate_gbps,
            locked_max_mhz=executor.locked_clock_mhz if executor is not None else lambda _i: None,
        )

    def _load_settings(self) -> tuple[LoadSettings | None, str]:
        """How to load the GPUs, or why no load can be generated here (``clocks_load``
        is then skipped with that reason, never passed)."""
        s = self.settings
        if not s.preflight_load:
            return None, "no load generated: disabled (preflight_load=false)"
        ranks = self._local_clients()
        if ranks:
            return None, f"no load generated: {ranks} job rank(s) connected to this agent"
        command, why_not = load_command(self.backend.api, s.preflight_load_command or ())
        if command is None:
            return None, why_not
        load = LoadSettings(
            command=tuple(command), seconds=s.preflight_load_s, grace_s=s.preflight_load_grace_s
        )
        return load, ""

    def _nic_inventory(self) -> list[NicInfo]:
        """The RDMA ports for the report's identity; empty (logged) when sysfs cannot say,
        so a NIC tree the agent cannot read neither stops its start nor sinks a tick."""
        gpus = {g.index: g.pci_bus_id for g in self.sampler.inventory if g.pci_bus_id}
        none: list[NicInfo] = []
        nics = self._part("NIC inventory", lambda: self.nics.inventory(gpus), none)
        return nics[:_MAX_NIC_INFOS]

    def _gpu_pods(self) -> dict[int, tuple[str, str]]:
        """GPU index -> (pod, namespace) from connected ranks that said both."""
        if self.endpoint is None:
            return {}
        out = {}
        for session in self.endpoint.sessions():
            hello = session.hello
            live = session.disconnected_unix_s is None
            if live and hello is not None and hello.pod and hello.gpu_index is not None:
                out[hello.gpu_index] = (hello.pod, hello.namespace)
        return out

    def _relay(self, cmd: JobCommand) -> int:
        return self.endpoint.enqueue(cmd) if self.endpoint is not None else 0

    def _on_ack(self, ack: CommandAck) -> None:
        self.stats.count_command(ack.status.value)
        self.batch.add_ack(ack)
        if not self._stopping.is_set():
            self._urgent.set()  # acks close the controller's command loop; send them soon
            self._wake.set()

    def _on_reply(self, reply: ReportReply) -> None:
        if reply.commands and self.executor is not None:
            self.executor.handle(reply.commands)
        if reply.peer_groups_unknown:  # the controller restarted: declare them again
            again = self.peer_groups.wanted(reply.peer_groups_unknown)
            if again.peer_groups:
                self.batch.add_records(again, len(again.model_dump_json()))
                self.request_report("the controller asked for peer groups")


def _configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )


def run(settings: AgentSettings) -> None:
    """Run the agent until SIGINT or SIGTERM; raises :class:`~agents.errors.AgentError`."""
    _configure_logging(settings.log_level)
    stop = threading.Event()
    foreground = settings.foreground
    if foreground is None:
        foreground = sys.stdin is not None and sys.stdin.isatty()
    if settings.token_file is not None:
        # Started by hand: a token file that is missing, unreadable or empty is a typo to
        # fix now, not 401s to find in the log. A DaemonSet's projected token may appear
        # after the agent starts, so there the reporter keeps re-reading it. A token that
        # no header can carry (a line break inside) is refused either way: no rewrite of
        # the file in progress looks like that.
        try:
            read_token_file(settings.token_file)
        except InvalidTokenError:
            raise
        except AgentConfigError:
            if foreground:
                raise
    if settings.job_listen and settings.job_token_file is not None:
        # Read now, before the spool, the GPU backend and the sockets start: a file that
        # cannot serve (a FIFO, a directory, no token long enough) is the same one-line
        # refusal, with nothing left behind, in the background too (a Secret is mounted
        # before the container starts; the endpoint keeps re-reading it afterwards).
        JobTokens(settings.job_token_file).load()
    agent = Agent(settings)
    if agent.backend.error and foreground:
        # Report the node unhealthy once (best effort), then fail loudly: a person who
        # started the agent by hand must see that its GPUs are not being watched.
        try:
            agent.start()
        finally:
            agent.stop()  # seals one report (the identity says gpu_error) and sends it
        raise GpuWatchError(
            f"{agent.backend.error}; reported node {settings.node_name} unhealthy. "
            "Run with --no-foreground to keep reporting, or gpus=sim:N to simulate"
        )

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        agent.start()
        agent.run_until(stop)
    finally:
        agent.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["Agent", "run"]
