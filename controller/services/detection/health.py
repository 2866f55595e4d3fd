"""GPU and node health: fatal XIDs, uncorrectable ECC growth, lost GPUs, silent agents.

Classification follows the Kubernetes NVIDIA device plugin and NVIDIA's XID catalogue:
application XIDs come from a bad kernel or a killed process, not from the hardware, so they
are recorded (one open ``application_xid`` record per GPU, its count growing) but never make
anything unhealthy. Quarantining a node for an XID-45 storm is the classic false positive.

=====  ==========================================  =========================
XID    meaning                                     class
=====  ==========================================  =========================
13     graphics engine exception                   application
31     GPU memory page fault                       application
43     GPU stopped processing                      application
45     preemptive cleanup, due to previous errors  application
48     double-bit ECC error                        fatal
61     internal micro-controller breakpoint        fatal
62     internal micro-controller halt              fatal
63     ECC page retirement / row remapping event   fatal
64     ECC page retirement / row remapping failure fatal
68     video processor exception                   application
74     NVLink error                                fatal
79     GPU has fallen off the bus                  fatal
92     high single-bit ECC error rate              fatal
94     contained ECC error                         fatal
95     uncontained ECC error                       fatal
119    GSP RPC timeout                             fatal
120    GSP error                                   fatal
=====  ==========================================  =========================

Codes in neither table are recorded as ``gpu_xid`` warnings (one open record per GPU) and
do not change health either: an unknown code is a reason to look, not to drain a node.

A fault (fatal XID, growth of the uncorrectable ECC count, a ``lost`` sample) opens one
``gpu_fault`` incident per GPU (later faults bump it) and marks the GPU and its node
unhealthy. It stays so until the incident is resolved. An agent silent for longer than
``node_lost_after_s`` (measured on the controller's clock) makes its node ``lost`` with a
``node_lost`` incident; its next report resolves that incident and the node returns to
healthy, or to unhealthy if a GPU fault is still open.

The agent's pre-failure signals (row remapping, retired pages, NVLink state, PCIe, fabric,
NVML hangs, NIC ports, bonds) are classified by the pure rule table in
:mod:`controller.logic.detection.hw_rules`: ``fatal`` findings take the ``gpu_fault`` path
above, ``degrade`` ones open one ``hw_degraded`` warning per GPU or NIC, NIC error rises an
``nic_errors`` info record; a node whose agent reports ``gpu_error`` (NVML broken where
NVIDIA devices exist) is unhealthy with a ``gpu_watch_failed`` incident until it reports
without one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from controller.db.keys import GpuKey, NodeKey, RowKey
from controller.logic.detection.hw_rules import HwFinding, HwRules
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
    fault_events: list[dict[str, Any]] = field(default_factory=list)
    lost: bool = False
    #: kind -> (count, events)
    xids: dict[str, tuple[int, list[dict[str, Any]]]] = field(default_factory=dict)


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
        #: Node -> why its GPUs cannot be watched (the agent's ``gpu_error``).
        self._gpu_errors: dict[str, str] = {}

    # ------------------------------------------------------------------ reports

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        node = self._state.nodes.get(report.node.name)
        if node is None:
            return
        if node.health == "lost":
            await self._node_back(node)
        findings: dict[int, _GpuFindings] = {}
        dirty: set[RowKey] = set()
        gpus = node.gpus
        for sample in report.samples:
            for g in sample.gpus:
                # Most samples are uneventful: check that cheaply before looking closer.
                if g.lost or g.xid_events:
                    self._inspect(node, g, sample.time_unix_s, findings, dirty)
                elif g.ecc_uncorrected_total is not None:
                    known = gpus.get(g.index)
                    if known is None or known.ecc_uncorrected_total != g.ecc_uncorrected_total:
                        self._inspect(node, g, sample.time_unix_s, findings, dirty)
        for index, found in sorted(findings.items()):
            if found.fault_reasons:
                await self._gpu_fault(node, index, found)
            for kind, (count, events) in found.xids.items():
                await self._record_xids(node, index, kind, count, events)
        await self._gpu_watch(node, report.node.gpu_error)
        for finding in self._hw.findings(report):
            await self._hw_finding(node, finding)
        if dirty:
            self._writer.mark_dirty(dirty)

    async def _gpu_watch(self, node: NodeState, error: str) -> None:
        """A node whose NVML is broken is unhealthy until its agent reports without error."""
        before = self._gpu_errors.get(node.name)
        if error == (before or ""):
            return
        key = f"gpu_watch_failed:{node.name}"
        if error:
            self._gpu_errors[node.name] = error
            self._recompute_node(node)
            await self._incidents.open_or_bump(
                IncidentSpec(
                    kind="gpu_watch_failed",
                    severity="critical",
                    summary=f"{node.name}: GPUs not watched: {error}",
                    dedupe_key=key,
                    node=node.name,
                    evidence={"gpu_error": error},
                ),
                also_write={NodeKey(node.name)},
            )
            return
        del self._gpu_errors[node.name]
        self._recompute_node(node)
        incident = self._incidents.find_open(key)
        if incident is not None:
            await self._incidents.resolve(
                incident, note="NVML works again", also_write={NodeKey(node.name)}
            )
        else:
            self._writer.mark_dirty({NodeKey(node.name)})

    async def _hw_finding(self, node: NodeState, f: HwFinding) -> None:
        event = {"time_unix_s": f.time_unix_s, "signal": f.signal, "detail": f.reason}
        if f.level == "fatal" and f.gpu_index is not None:
            found = _GpuFindings(fault_reasons=[f.reason], fault_events=[event])
            await self._gpu_fault(node, f.gpu_index, found)
            return
        if f.level == "fatal":
            return  # node-level fatal (gpu_watch_failed) is handled by _gpu_watch
        if f.level == "degrade":
            kind, severity = "hw_degraded", "warning"
        elif f.signal == "nic_errors_rising":
            kind, severity = "nic_errors", "info"
        else:
            return
        where = f.device or (f"gpu{f.gpu_index}" if f.gpu_index is not None else "node")
        await self._incidents.open_or_bump(
            IncidentSpec(
                kind=kind,
                severity=severity,
                summary=f"{node.name}: {f.reason}",
                dedupe_key=f"{kind}:{node.name}:{where}",
                node=node.name,
                gpu_index=f.gpu_index,
                evidence={"signal": f.signal, "device": f.device},
            ),
            events=[event],
        )

    def _inspect(
        self,
        node: NodeState,
        sample: wire.GpuSample,
        time_unix_s: float,
        findings: dict[int, _GpuFindings],
        dirty: set[RowKey],
    ) -> None:
        gpu = node.gpus.get(sample.index)
        if sample.lost:
            found = findings.setdefault(sample.index, _GpuFindings())
            if not found.lost:
                found.lost = True
                found.fault_reasons.append(f"GPU {sample.index} lost: the driver cannot reach it")
                found.fault_events.append({"time_unix_s": time_unix_s, "lost": True})
        for event in sample.xid_events:
            index = sample.index if event.gpu_index is None else event.gpu_index
            found = findings.setdefault(index, _GpuFindings())
            record: dict[str, Any] = {"time_unix_s": event.time_unix_s, "xid": event.code}
            if event.detail:
                record["detail"] = event.detail
            cls = xid_class(event.code)
            if cls == "fatal":
                found.fault_reasons.append(
                    f"XID {event.code} on GPU {index}: {FATAL_XIDS[event.code]}"
                )
                found.fault_events.append(record)
            else:
                kind = "application_xid" if cls == "application" else "gpu_xid"
                count, events = found.xids.get(kind, (0, []))
                events.append(record)
                found.xids[kind] = (count + 1, events)
        value = sample.ecc_uncorrected_total
        if gpu is not None and value is not None:
            before = gpu.ecc_uncorrected_total
            if before is not None and value > before:
                found = findings.setdefault(sample.index, _GpuFindings())
                found.fault_reasons.append(
                    f"uncorrectable ECC errors on GPU {sample.index}: {before} -> {value}"
                )
                found.fault_events.append(
                    {"time_unix_s": time_unix_s, "ecc_uncorrected_total": value, "before": before}
                )
            if before != value:
                # Also when it drops (a driver reload resets the volatile counter).
                gpu.ecc_uncorrected_total = value
                dirty.add(GpuKey(node.name, sample.index))

    async def _gpu_fault(self, node: NodeState, index: int, found: _GpuFindings) -> None:
        gpu = node.gpus.get(index)
        if gpu is None:
            gpu = node.gpus[index] = GpuState(index=index)
        reason = found.fault_reasons[0]
        changed = gpu.health == "healthy" or (found.lost and gpu.health != "lost")
        if changed:
            gpu.health = "lost" if found.lost else "unhealthy"
            gpu.health_reason = reason
            self._recompute_node(node)
            log.warning(
                "gpu unhealthy",
                extra={"fields": {"node": node.name, "gpu": index, "reason": reason}},
            )
        spec = IncidentSpec(
            kind="gpu_fault",
            severity="critical",
            summary=f"{node.name}: {reason}",
            dedupe_key=f"gpu_fault:{node.name}:{index}",
            node=node.name,
            gpu_index=index,
            evidence={"reasons": found.fault_reasons[:20]},
        )
        await self._incidents.open_or_bump(
            spec,
            count=len(found.fault_events),
            events=found.fault_events,
            also_write={NodeKey(node.name), GpuKey(node.name, index)},
        )

    async def _record_xids(
        self, node: NodeState, index: int, kind: str, count: int, events: list[dict[str, Any]]
    ) -> None:
        codes = sorted({e["xid"] for e in events})
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
            evidence={"codes": {}},
        )
        existing = self._incidents.find_open(spec.dedupe_key)
        by_code: dict[str, int] = (
            existing.evidence.setdefault("codes", {}) if existing is not None else {}
        )
        if existing is None:
            spec.evidence = {"codes": by_code}
        for event in events:
            by_code[str(event["xid"])] = by_code.get(str(event["xid"]), 0) + 1
        await self._incidents.open_or_bump(spec, count=count, events=events)

    # ------------------------------------------------------------------ silence

    async def tick(self, now_unix_s: float) -> None:
        for node in list(self._state.nodes.values()):
            if node.health == "lost" or node.last_seen_unix_s <= 0:
                continue
            silent_s = now_unix_s - node.last_seen_unix_s
            if silent_s <= self.node_lost_after_s:
                continue
            before = (node.health, node.health_reason)
            node.health = "lost"
            node.health_reason = (
                f"no report for {silent_s:.0f} s (node_lost_after_s={self.node_lost_after_s:g})"
            )
            try:
                await self._incidents.open_or_bump(
                    IncidentSpec(
                        kind="node_lost",
                        severity="critical",
                        summary=f"{node.name}: agent silent for {silent_s:.0f} s",
                        dedupe_key=f"node_lost:{node.name}",
                        node=node.name,
                        evidence={"last_report_unix_s": node.last_report_unix_s},
                    ),
                    also_write={NodeKey(node.name)},
                )
            except Exception:
                # Not recorded: stay as we were so the next tick tries again.
                node.health, node.health_reason = before
                raise
            log.warning(
                "node lost", extra={"fields": {"node": node.name, "silent_s": round(silent_s, 1)}}
            )

    async def _node_back(self, node: NodeState) -> None:
        node.health = "healthy"
        self._recompute_node(node)
        log.info(
            "node reporting again",
            extra={"fields": {"node": node.name, "health": node.health}},
        )
        incident = self._incidents.find_open(f"node_lost:{node.name}")
        if incident is not None:
            await self._incidents.resolve(
                incident, note="agent reported again", also_write={NodeKey(node.name)}
            )
        else:
            self._writer.mark_dirty({NodeKey(node.name)})

    # ------------------------------------------------------------------ resolution

    def _on_resolved(self, incident: IncidentState) -> set[RowKey]:
        """An operator resolved a GPU fault: the GPU is trusted again."""
        if incident.kind != "gpu_fault" or incident.node is None or incident.gpu_index is None:
            return set()
        node = self._state.nodes.get(incident.node)
        gpu = None if node is None else node.gpus.get(incident.gpu_index)
        if node is None or gpu is None:
            return set()
        gpu.health = "healthy"
        gpu.health_reason = ""
        self._recompute_node(node)
        log.info(
            "gpu healthy again",
            extra={"fields": {"node": node.name, "gpu": gpu.index, "incident": incident.id}},
        )
        return {NodeKey(node.name), GpuKey(node.name, gpu.index)}

    def _recompute_node(self, node: NodeState) -> None:
        if node.health == "lost":
            return
        bad = [
            g for g in sorted(node.gpus.values(), key=lambda g: g.index) if g.health != "healthy"
        ]
        before = node.health
        gpu_error = self._gpu_errors.get(node.name)
        if gpu_error:
            node.health, node.health_reason = "unhealthy", f"GPUs not watched: {gpu_error}"
        elif bad:
            more = f" (+{len(bad) - 1} more GPUs)" if len(bad) > 1 else ""
            node.health, node.health_reason = "unhealthy", bad[0].health_reason + more
        else:
            node.health, node.health_reason = "healthy", ""
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
