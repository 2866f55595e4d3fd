"""GPU and node health: fatal XIDs, uncorrectable ECC growth, lost GPUs, silent agents.

Classification follows the Kubernetes NVIDIA device plugin and NVIDIA's XID catalogue:
application XIDs come from a bad kernel or a killed process, not from the hardware, so they
are recorded (one open ``application_xid`` record per GPU, its count growing) but never make
anything unhealthy. Quarantining a node for an XID-45 storm is the classic false positive.

The two tables are :data:`FATAL_XIDS` and :data:`APPLICATION_XIDS` below (docs/controller.md
lists them with their meaning).

Codes in neither table are recorded as ``gpu_xid`` warnings (one open record per GPU) and
do not change health either: an unknown code is a reason to look, not to drain a node.

A fault (fatal XID, growth of the uncorrectable ECC count, a ``lost`` sample) opens one
``gpu_fault`` incident per GPU (later faults bump it) and marks the GPU and its node
unhealthy. It stays so until the incident is resolved. An agent silent for longer than
``node_lost_after_s`` (measured on the controller's clock) makes its node ``lost`` with a
``node_lost`` incident; its next report resolves that incident and the node returns to
healthy, or to unhealthy if a GPU fault is still open. An ``unreachable`` GPU (no NVML read
answers) is unhealthy with a ``gpu_unreachable`` incident until a sample reads it again.

The agent's pre-failure signals (row remapping, retired pages, NVLink state, PCIe, fabric,
NVML hangs, NIC ports, bonds) are classified by the pure rule table in
:mod:`controller.logic.detection.hw_rules`: ``fatal`` findings take the ``gpu_fault`` path
above, ``degrade`` ones open one ``hw_degraded`` warning per GPU or NIC, NIC error rises an
``nic_errors`` info record; a node whose agent reports ``gpu_error`` (NVML broken where
NVIDIA devices exist) is unhealthy with a ``gpu_watch_failed`` incident until it reports
without one. A GPU's ``hw_degraded`` warning resolves once its standing conditions clear
(:mod:`.hw_clear`).

Every health change is written before it is shown (issue 14): the detector stages it on a
copy of the node, writes the copy's rows in the incident's transaction, and applies it to
:class:`~controller.state.ClusterState` only once that committed. If the database does not
take it, the API keeps showing what is stored, the failure is logged and counted
(``IncidentService.write_failures``), and the node's next report (or the next tick, for a
silent node) detects the same condition again and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Table

from controller.db.keys import GpuKey, NodeKey, RowKey
from controller.db.repositories import write_batch
from controller.db.repositories.nodes import gpu_row, node_row
from controller.logic.detection.hw_rules import HwFinding, HwRules, hw_incident_key
from controller.logic.detection.incident_evidence import (
    EvidenceEvent,
    GpuFaultEvidence,
    GpuWatchEvidence,
    HwEvidence,
    NodeLostEvidence,
    XidEvidence,
)
from controller.logic.incident_kinds import IncidentKind
from controller.services.detection.hw_clear import HwClearer
from controller.services.incidents import IncidentService, IncidentSpec
from controller.state import ClusterState, GpuState, IncidentState, NodeState
from controller.writer import GroupCommitWriter
from trainguard import wire

log = logging.getLogger(__name__)

FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping event",
    64: "ECC page retirement / row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    68: "video processor exception",
}


def xid_class(code: int) -> str:
    if code in FATAL_XIDS:
        return "fatal"
    if code in APPLICATION_XIDS:
        return "application"
    return "unknown"


@dataclass(slots=True)
class _GpuFindings:
    fault_reasons: list[str] = field(default_factory=list)
    fault_events: list[EvidenceEvent] = field(default_factory=list)
    lost: bool = False
    #: kind -> (count, events)
    xids: dict[IncidentKind, tuple[int, list[EvidenceEvent]]] = field(default_factory=dict)


@dataclass(slots=True)
class _Staged:
    """A health change of one node, made on a copy: its rows are written, then it is applied."""

    live: NodeState
    copy: NodeState
    #: GPUs whose rows the change touches.
    gpus: set[int] = field(default_factory=set)
    #: ``False``: only the GPUs' counters change (a reset baseline): the node's row is not
    #: written and no health is published, so a health change made meanwhile stays.
    health: bool = True

    @classmethod
    def of(cls, node: NodeState, *, health: bool = True) -> _Staged:
        gpus = {i: replace(g) for i, g in node.gpus.items()}
        return cls(node, replace(node, gpus=gpus), health=health)

    def rows(self) -> dict[Table, list[dict[str, Any]]]:
        name = self.copy.name
        rows: dict[Table, list[dict[str, Any]]] = {}
        if self.health:
            rows[NodeKey.table] = [node_row(self.copy)]
        if self.gpus:
            rows[GpuKey.table] = [gpu_row(name, self.copy.gpus[i]) for i in sorted(self.gpus)]
        return rows

    def apply(self) -> None:
        """Publish the change to memory (the database has it)."""
        node, copy = self.live, self.copy
        before = node.health
        if self.health:
            node.health, node.health_reason = copy.health, copy.health_reason
        for index in self.gpus:
            staged, gpu = copy.gpus[index], node.gpus.get(index)
            if gpu is None:
                node.gpus[index] = staged
                continue
            if self.health:
                gpu.health, gpu.health_reason = staged.health, staged.health_reason
            gpu.ecc_uncorrected_total = staged.ecc_uncorrected_total
        if node.health != before:
            log.warning(
                "node health changed",
                extra={
                    "fields": {
                        "node": node.name,
                        "from": before,
                        "to": node.health,
                        "reason": node.health_reason,
                    }
                },
            )


async def _each(steps: list[Awaitable[None]]) -> None:
    """Await every step even when one fails (one GPU's failed write must not hide another
    GPU's fault); the first failure is raised at the end, for the caller to log."""
    first: Exception | None = None
    left = list(reversed(steps))
    try:
        while left:
            try:
                await left.pop()
            except Exception as exc:
                first = first or exc
    finally:
        # Cancelled midway (the controller stopping): the steps not reached are closed, not
        # left to warn "coroutine was never awaited" at garbage collection.
        for step in left:
            if isinstance(step, Coroutine):
                step.close()
    if first is not None:
        raise first


def _reach_key(node: str, index: int) -> str:
    """The dedupe key of a GPU's ``gpu_unreachable`` incident."""
    return f"gpu_unreachable:{node}:{index}"


class HealthDetector:
    """A ``ReportObserver`` and ``Ticker`` that keeps node and GPU health."""

    def __init__(
        self,
        state: ClusterState,
        incidents: IncidentService,
        writer: GroupCommitWriter,
        *,
        node_lost_after_s: float,
    ) -> None:
        self._state = state
        self._incidents = incidents
        self._writer = writer
        self.node_lost_after_s = node_lost_after_s
        self.tick_interval_s = min(1.0, node_lost_after_s / 4)
        incidents.resolve_hooks.append(self._on_resolved)
        self._hw = HwRules()
        self._hw_clear = HwClearer(incidents)
        #: Node -> why its GPUs cannot be watched (the agent's ``gpu_error``).
        self._gpu_errors: dict[str, str] = {}

    # ------------------------------------------------------------------ reports

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        node = self._state.nodes.get(report.node.name)
        if node is None:
            return
        steps: list[Awaitable[None]] = []
        if node.health == "lost":
            steps.append(self._node_back(node))
        findings: dict[int, _GpuFindings] = {}
        #: GPU -> its uncorrectable ECC count as this report leaves it (memory not yet).
        ecc: dict[int, int] = {}
        gpus = node.gpus
        reach: dict[int, str | None] = {}  # GPU -> why no read answers; None: it reads
        for sample in report.samples:
            for g in sample.gpus:
                if not g.unknown:  # a hung tick says neither
                    reach[g.index] = (g.error or "no NVML read answered") if g.unreachable else None
                # Most samples are uneventful: check that cheaply before looking closer.
                if g.lost or g.xid_events:
                    self._inspect(node, g, sample.time_unix_s, findings, ecc)
                elif g.ecc_uncorrected_total is not None:
                    known = gpus.get(g.index)
                    seen = ecc.get(g.index, None if known is None else known.ecc_uncorrected_total)
                    if known is None or seen != g.ecc_uncorrected_total:
                        self._inspect(node, g, sample.time_unix_s, findings, ecc)
        for index, found in sorted(findings.items()):
            if found.fault_reasons:
                # The new ECC count goes with the fault: not stored, it is seen again.
                steps.append(self._gpu_fault(node, index, found, ecc.pop(index, None)))
            for kind, (count, events) in found.xids.items():
                steps.append(self._record_xids(node, index, kind, count, events))
        steps.append(self._gpu_watch(node, report.node.gpu_error))
        # A change only (a GPU turning unreachable, or reading again with its incident open):
        # most reports have neither, and ingest is the hot path.
        steps.extend(
            self._gpu_reach(node, index, why)
            for index, why in sorted(reach.items())
            if why is not None or self._incidents.find_open(_reach_key(node.name, index))
        )
        steps.extend(self._hw_finding(node, f) for f in self._hw.findings(report))
        steps.append(self._hw_clear.check(report))  # after the findings: sees their opens
        # Counter values with no fault: the baseline the next fault is judged against, also
        # by a restarted controller. A GPU's first value came with the report's own commit
        # (``IngestService._first_ecc_baselines``: many nodes' first reports share one
        # transaction); a change of a known baseline (rare: a driver reload) is stored, then
        # shown, as is a first value the ingest did not set (none is expected).
        resets: dict[int, int] = {}
        for index, value in ecc.items():
            gpu = gpus.get(index)
            if gpu is not None and gpu.ecc_uncorrected_total != value:
                resets[index] = value
        if resets:
            steps.append(self._store_counters(node, resets))
        await _each(steps)

    async def _store_counters(self, node: NodeState, counters: dict[int, int]) -> None:
        """Write the GPUs' reset uncorrectable-ECC counters, then show them; not stored,
        they stay as they were and the next report carrying them tries again."""
        staged = _Staged.of(node, health=False)
        for index, value in counters.items():
            gpu = staged.copy.gpus.get(index)
            if gpu is not None:
                gpu.ecc_uncorrected_total = value
                staged.gpus.add(index)
        await self._store(staged, staged.apply)

    async def _gpu_watch(self, node: NodeState, error: str) -> None:
        """A node whose NVML is broken is unhealthy until its agent reports without error."""
        before = self._gpu_errors.get(node.name)
        if error == (before or ""):
            return
        key = f"gpu_watch_failed:{node.name}"
        staged = _Staged.of(node)
        self._recompute(staged.copy, error or None)

        def publish() -> None:
            if error:
                self._gpu_errors[node.name] = error
            else:
                self._gpu_errors.pop(node.name, None)
            staged.apply()

        if error:
            await self._incidents.open_or_bump(
                IncidentSpec(
                    kind=IncidentKind.GPU_WATCH_FAILED,
                    severity="critical",
                    summary=f"{node.name}: GPUs not watched: {error}",
                    dedupe_key=key,
                    node=node.name,
                    evidence=GpuWatchEvidence(gpu_error=error),
                ),
                rows=staged.rows(),
                on_written=publish,
            )
            return
        incident = self._incidents.find_open(key)
        if incident is not None:
            await self._incidents.resolve(
                incident, note="NVML works again", rows=staged.rows(), on_written=publish
            )
        else:
            await self._store(staged, publish)

    async def _gpu_reach(self, node: NodeState, index: int, why: str | None) -> None:
        """Open ``gpu_unreachable`` (the GPU unhealthy) or resolve it, on a change only: the
        resolve hook (:meth:`_on_resolved`) gives the GPU its health back, as for an operator."""
        key = _reach_key(node.name, index)
        incident = self._incidents.find_open(key)
        if why is None and incident is not None:
            await self._incidents.resolve(incident, note="NVML reads the GPU again")
        if why is None or incident is not None:
            return
        staged = _Staged.of(node)
        staged.gpus.add(index)
        gpu = staged.copy.gpus.setdefault(index, GpuState(index=index))
        summary = f"GPU {index} unreachable: {why}"
        if gpu.health == "healthy":
            gpu.health, gpu.health_reason = "unhealthy", summary
            self._recompute(staged.copy, self._gpu_errors.get(node.name))
        spec = IncidentSpec(
            kind=IncidentKind.GPU_UNREACHABLE, severity="critical", dedupe_key=key,
            summary=f"{node.name}: {summary}", node=node.name, gpu_index=index,
            evidence=GpuWatchEvidence(gpu_error=why),
        )  # fmt: skip
        await self._incidents.open_or_bump(spec, rows=staged.rows(), on_written=staged.apply)

    async def _hw_finding(self, node: NodeState, f: HwFinding) -> None:
        event = EvidenceEvent(time_unix_s=f.time_unix_s, signal=f.signal, detail=f.reason)
        if f.level == "fatal" and f.gpu_index is not None:
            found = _GpuFindings(fault_reasons=[f.reason], fault_events=[event])
            await self._gpu_fault(node, f.gpu_index, found, None)
            return
        if f.level == "fatal":
            return  # node-level fatal (gpu_watch_failed) is handled by _gpu_watch
        if f.level == "degrade":
            kind, severity = IncidentKind.HW_DEGRADED, "warning"
        elif f.signal == "nic_errors_rising":
            kind, severity = IncidentKind.NIC_ERRORS, "info"
        else:
            return
        await self._incidents.open_or_bump(
            IncidentSpec(
                kind=kind,
                severity=severity,
                summary=f"{node.name}: {f.reason}",
                dedupe_key=hw_incident_key(kind, node.name, f.gpu_index, f.device),
                node=node.name,
                gpu_index=f.gpu_index,
                evidence=HwEvidence(signal=f.signal, device=f.device),
            ),
            events=[event],
        )

    def _inspect(
        self,
        node: NodeState,
        sample: wire.GpuSample,
        time_unix_s: float,
        findings: dict[int, _GpuFindings],
        ecc: dict[int, int],
    ) -> None:
        """Classify one GPU sample; changes nothing but ``findings`` and ``ecc``."""
        gpu = node.gpus.get(sample.index)
        if sample.lost:
            found = findings.setdefault(sample.index, _GpuFindings())
            if not found.lost:
                found.lost = True
                found.fault_reasons.append(f"GPU {sample.index} lost: the driver cannot reach it")
                found.fault_events.append(EvidenceEvent(time_unix_s=time_unix_s, lost=True))
        for event in sample.xid_events:
            index = sample.index if event.gpu_index is None else event.gpu_index
            found = findings.setdefault(index, _GpuFindings())
            record = EvidenceEvent(time_unix_s=event.time_unix_s, xid=event.code)
            if event.detail:
                record.detail = event.detail
            cls = xid_class(event.code)
            if cls == "fatal":
                found.fault_reasons.append(
                    f"XID {event.code} on GPU {index}: {FATAL_XIDS[event.code]}"
                )
                found.fault_events.append(record)
            else:
                kind = (
                    IncidentKind.APPLICATION_XID if cls == "application" else IncidentKind.GPU_XID
                )
                count, events = found.xids.get(kind, (0, []))
                events.append(record)
                found.xids[kind] = (count + 1, events)
        value = sample.ecc_uncorrected_total
        if gpu is not None and value is not None:
            before = ecc.get(sample.index, gpu.ecc_uncorrected_total)
            if before is not None and value > before:
                found = findings.setdefault(sample.index, _GpuFindings())
                found.fault_reasons.append(
                    f"uncorrectable ECC errors on GPU {sample.index}: {before} -> {value}"
                )
                found.fault_events.append(
                    EvidenceEvent(
                        time_unix_s=time_unix_s, ecc_uncorrected_total=value, before=before
                    )
                )
            # Also when it drops (a driver reload resets the volatile counter).
            ecc[sample.index] = value

    async def _gpu_fault(
        self, node: NodeState, index: int, found: _GpuFindings, ecc_value: int | None
    ) -> None:
        staged = _Staged.of(node)
        staged.gpus.add(index)
        gpu = staged.copy.gpus.get(index)
        if gpu is None:
            gpu = staged.copy.gpus[index] = GpuState(index=index)
        if ecc_value is not None:
            gpu.ecc_uncorrected_total = ecc_value
        reason = found.fault_reasons[0]
        changed = gpu.health == "healthy" or (found.lost and gpu.health != "lost")
        if changed:
            gpu.health = "lost" if found.lost else "unhealthy"
            gpu.health_reason = reason
            self._recompute(staged.copy, self._gpu_errors.get(node.name))

        def publish() -> None:
            staged.apply()
            if changed:
                log.warning(
                    "gpu unhealthy",
                    extra={"fields": {"node": node.name, "gpu": index, "reason": reason}},
                )

        spec = IncidentSpec(
            kind=IncidentKind.GPU_FAULT,
            severity="critical",
            summary=f"{node.name}: {reason}",
            dedupe_key=f"gpu_fault:{node.name}:{index}",
            node=node.name,
            gpu_index=index,
            evidence=GpuFaultEvidence(reasons=found.fault_reasons[:20]),
        )
        await self._incidents.open_or_bump(
            spec,
            count=len(found.fault_events),
            events=found.fault_events,
            rows=staged.rows(),
            on_written=publish,
        )

    async def _record_xids(
        self,
        node: NodeState,
        index: int,
        kind: IncidentKind,
        count: int,
        events: list[EvidenceEvent],
    ) -> None:
        codes = sorted({e.xid for e in events if e.xid is not None})
        known = APPLICATION_XIDS if kind == "application_xid" else {}
        names = ", ".join(f"{c} ({known[c]})" if c in known else str(c) for c in codes)
        label = "application XID" if kind == "application_xid" else "unclassified XID"
        spec = IncidentSpec(
            kind=kind,
            severity="info" if kind == "application_xid" else "warning",
            summary=f"{node.name}: {label} {names} on GPU {index}",
            dedupe_key=f"{kind}:{node.name}:{index}",
            node=node.name,
            gpu_index=index,
        )
        existing = self._incidents.find_open(spec.dedupe_key)
        # A new dict, never the open incident's own: counted once the bump is stored.
        seen = existing.evidence if existing is not None else None
        by_code: dict[str, int] = dict(seen.codes if isinstance(seen, XidEvidence) else {})
        for event in events:
            by_code[str(event.xid)] = by_code.get(str(event.xid), 0) + 1
        await self._incidents.open_or_bump(
            spec, count=count, events=events, evidence_update=XidEvidence(codes=by_code)
        )

    # ------------------------------------------------------------------ silence

    async def tick(self, now_unix_s: float) -> None:
        steps: list[Awaitable[None]] = []
        for node in list(self._state.nodes.values()):
            if node.health == "lost" or node.last_seen_unix_s <= 0:
                continue
            silent_s = now_unix_s - node.last_seen_unix_s
            if silent_s > self.node_lost_after_s:
                steps.append(self._node_lost(node, silent_s))
        await _each(steps)

    async def _node_lost(self, node: NodeState, silent_s: float) -> None:
        """Record a silent node as lost; not stored, it stays as it was for the next tick."""
        staged = _Staged.of(node)
        staged.copy.health = "lost"
        staged.copy.health_reason = (
            f"no report for {silent_s:.0f} s (node_lost_after_s={self.node_lost_after_s:g})"
        )

        def publish() -> None:
            staged.apply()
            log.warning(
                "node lost", extra={"fields": {"node": node.name, "silent_s": round(silent_s, 1)}}
            )

        await self._incidents.open_or_bump(
            IncidentSpec(
                kind=IncidentKind.NODE_LOST,
                severity="critical",
                summary=f"{node.name}: agent silent for {silent_s:.0f} s",
                dedupe_key=f"node_lost:{node.name}",
                node=node.name,
                evidence=NodeLostEvidence(last_report_unix_s=node.last_report_unix_s),
            ),
            rows=staged.rows(),
            on_written=publish,
        )

    async def _node_back(self, node: NodeState) -> None:
        staged = _Staged.of(node)
        staged.copy.health = "healthy"
        self._recompute(staged.copy, self._gpu_errors.get(node.name))

        def publish() -> None:
            staged.apply()
            log.info(
                "node reporting again",
                extra={"fields": {"node": node.name, "health": node.health}},
            )

        incident = self._incidents.find_open(f"node_lost:{node.name}")
        if incident is not None:
            await self._incidents.resolve(
                incident, note="agent reported again", rows=staged.rows(), on_written=publish
            )
        else:  # its incident was resolved by hand while the node was still silent
            await self._store(staged, publish)

    async def _store(self, staged: _Staged, publish: Callable[[], None]) -> None:
        """A change with no incident to go with (health, or counters): its rows alone, then
        published.
        Not stored, it raises with memory unchanged, and the node's next report tries again."""
        rows = staged.rows()
        await self._writer.run(lambda conn: write_batch(conn, rows))
        publish()

    # ------------------------------------------------------------------ resolution

    def _on_resolved(self, incident: IncidentState) -> set[RowKey]:
        """A GPU fault or unreachable GPU resolved: the GPU is trusted again, unless the
        other is still open (its reason then stands).

        A resolve hook: the incident service saved the node and puts it back if the
        resolution is not stored."""
        kinds = ("gpu_fault", "gpu_unreachable")
        if incident.kind not in kinds or incident.node is None or incident.gpu_index is None:
            return set()
        node = self._state.nodes.get(incident.node)
        gpu = None if node is None else node.gpus.get(incident.gpu_index)
        if node is None or gpu is None:
            return set()
        other = "gpu_unreachable" if incident.kind == "gpu_fault" else "gpu_fault"
        still = self._incidents.find_open(f"{other}:{node.name}:{gpu.index}")
        if still is None:
            gpu.health, gpu.health_reason = "healthy", ""
        else:  # the GPU stays out, for the reason still open
            gpu.health = "unhealthy" if gpu.health == "healthy" else gpu.health
            gpu.health_reason = still.summary.removeprefix(f"{node.name}: ")
        self._recompute(node, self._gpu_errors.get(node.name))
        log.info(
            "gpu healthy again" if still is None else "gpu incident resolved, another stands",
            extra={"fields": {"node": node.name, "gpu": gpu.index, "incident": incident.id}},
        )
        return {NodeKey(node.name), GpuKey(node.name, gpu.index)}

    @staticmethod
    def _recompute(node: NodeState, gpu_error: str | None) -> None:
        """Derive ``node``'s health from its GPUs and NVML's state (a lost node stays lost)."""
        if node.health == "lost":
            return
        bad = [
            g for g in sorted(node.gpus.values(), key=lambda g: g.index) if g.health != "healthy"
        ]
        if gpu_error:
            node.health, node.health_reason = "unhealthy", f"GPUs not watched: {gpu_error}"
        elif bad:
            more = f" (+{len(bad) - 1} more GPUs)" if len(bad) > 1 else ""
            node.health, node.health_reason = "unhealthy", bad[0].health_reason + more
        else:
            node.health, node.health_reason = "healthy", ""
