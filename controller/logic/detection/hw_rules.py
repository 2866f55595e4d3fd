"""Which hardware signal means what: the rule table for the agent's pre-failure signals.

Pure: plain data in, findings out, no I/O, no clock. The health detector feeds it every
report and acts on the findings. Three levels, as NVSentinel and DCGM health watches
classify (docs/agent.md, "Health rules", is the table for operators):

``fatal``
    The GPU (or node) must not run work: it is marked unhealthy and a ``gpu_fault``
    incident opens (the remediation policy isolates on it).
``degrade``
    Works, but worse or at risk (a link down, a remap waiting for a reset, NVML not
    answering): one ``hw_degraded`` warning incident per GPU or NIC, health unchanged.
``count``
    Only counted (metrics, sample history): corrected ECC, replays, CRC errors, throttling.
    NIC error-rate rises are also kept as an ``nic_errors`` info record, the evidence the
    slow-link investigation starts from.

Conditions that persist (a remap pending for hours) produce one finding when they appear,
not one per report; the memo of what was seen is per (node, GPU/port). When they clear,
:mod:`.hw_clearing` decides when the GPU's warning resolves itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainguard import wire

Level = Literal["fatal", "degrade", "count"]

#: Retired pages (single + double bit) at which DCGM fails a board's memory health.
RETIRED_PAGES_LIMIT = 60

#: signal -> (level, meaning). The docs table is generated from the same words.
RULES: dict[str, tuple[Level, str]] = {
    "gpu_lost": ("fatal", "NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus"),
    "xid_fatal": ("fatal", "an XID in the fatal list (48, 61-64, 74, 79, 92, 94, 95, 119, 120)"),
    "ecc_uncorrectable": ("fatal", "the volatile uncorrectable ECC count grew"),
    "row_remap_failed": ("fatal", "a row could not be remapped: the GPU needs service"),
    "retired_pages_limit": ("fatal", f"{RETIRED_PAGES_LIMIT}+ retired pages (DCGM's limit)"),
    "fabric_failed": ("fatal", "the GPU's NVLink fabric registration failed (status != 0)"),
    "gpu_watch_failed": ("fatal", "NVML fails on a node with NVIDIA devices (node-level)"),
    "gpu_unknown": ("degrade", "an NVML call hung past the agent's timeout"),
    "row_remap_pending": ("degrade", "a remap waits for a GPU reset"),
    "retired_pages_pending": ("degrade", "a page retirement waits for a GPU reset"),
    "nvlink_down": ("degrade", "an NVLink that was up at agent start is down"),
    "pcie_link_degraded": ("degrade", "PCIe width below max, or generation below max while busy"),
    "fabric_not_ready": ("degrade", "fabric state not_started / in_progress"),
    "nic_port_down": ("degrade", "an RDMA port left ACTIVE, or flapped (link_downed rose)"),
    "nic_gone": ("degrade", "an RDMA device disappeared from sysfs"),
    "bond_member_down": ("degrade", "an Ethernet bond member's MII status went down"),
    "nic_errors_rising": ("count", "an RDMA error counter rose past the agent's threshold"),
    "xid_other": ("count", "application / unclassified XIDs (recorded, never unhealthy)"),
    "ecc_corrected": ("count", "corrected ECC errors (volatile, aggregate, by location)"),
    "remapped_rows": ("count", "rows remapped (correctable / uncorrectable causes)"),
    "pcie_replays": ("count", "PCIe replay counter"),
    "nvlink_errors": ("count", "NVLink CRC / replay / recovery counters"),
    "throttle": ("count", "clocks-event (throttle) reasons"),
    "mig_mode": ("count", "MIG mode current / pending"),
    "nic_congestion": ("count", "RoCE CNP / ECN counters"),
}

_EVENT_SIGNALS = {
    "pcie_link_degraded": None,
    "nic_port_down": None,
    "nic_gone": None,
    "bond_member_down": None,
    "nic_errors_rising": None,
}


@dataclass(frozen=True, slots=True)
class HwFinding:
    signal: str
    level: Level
    node: str
    gpu_index: int | None
    #: NIC device (or bond) the finding is about, for per-device dedupe.
    device: str
    reason: str
    time_unix_s: float


def hw_incident_key(kind: str, node: str, gpu_index: int | None, device: str = "") -> str:
    """The dedupe key of a hardware warning (``hw_degraded``, ``nic_errors``): one per
    NIC or bond (``device``), else per GPU, else per node. The health detector opens by
    it and the clearing rule finds a GPU's open warning by it."""
    where = device or (f"gpu{gpu_index}" if gpu_index is not None else "node")
    return f"{kind}:{node}:{where}"


class HwRules:
    """Turns reports into findings; remembers standing conditions so each is found once.

    Standing conditions (a remap pending, a link down) are read from the *last* sample of
    each report: they persist, so the last sample has them, and reading one sample instead
    of all keeps the cost per report small. Edge events (flaps, NICs gone) come from every
    sample's ``events``.
    """

    def __init__(self) -> None:
        #: (node, GPU) -> flags standing at the last report, e.g. "nvlink_down:7".
        self._seen: dict[tuple[str, int], frozenset[str]] = {}

    def findings(self, report: wire.Report) -> list[HwFinding]:
        node = report.node.name
        out: list[HwFinding] = []
        if report.node.gpu_error:
            t = report.samples[-1].time_unix_s if report.samples else report.sent_unix_s
            out.append(self._finding("gpu_watch_failed", node, None, "", report.node.gpu_error, t))
        if report.samples:
            last = report.samples[-1]
            for g in last.gpus:
                out += self._gpu(node, g, last.time_unix_s)
        for sample in report.samples:
            for event in sample.events:
                if event.kind in _EVENT_SIGNALS:
                    where = event.device or (
                        f"GPU {event.gpu_index}" if event.gpu_index is not None else ""
                    )
                    reason = event.detail or f"{event.kind} on {where}"
                    out.append(
                        self._finding(
                            event.kind, node, event.gpu_index, event.device, reason,
                            event.time_unix_s,
                        )
                    )  # fmt: skip
        return out

    def _finding(
        self, signal: str, node: str, gpu: int | None, device: str, reason: str, t: float
    ) -> HwFinding:
        return HwFinding(signal, RULES[signal][0], node, gpu, device, reason, t)

    def _gpu(self, node: str, g: wire.GpuSample, t: float) -> list[HwFinding]:
        key = (node, g.index)
        before = self._seen.get(key, frozenset())
        standing = standing_conditions(g)
        if g.unknown or g.lost:
            # Nothing else was read: keep what stood before, apart from "unknown" itself.
            now = frozenset(standing) | (before - {"gpu_unknown"})
        else:
            now = frozenset(standing)
        if not now and not before:
            return []
        self._seen[key] = now
        return [
            self._finding(signal, node, g.index, "", reason, t)
            for flag, (signal, reason) in standing.items()
            if flag not in before
        ]


def standing_conditions(g: wire.GpuSample) -> dict[str, tuple[str, str]]:
    """flag -> (signal, reason) for every condition standing in this sample (usually none).

    Public because the clearing rule (:mod:`.hw_clearing`) must judge "nothing stands" by
    the very test that found the condition, or the two would disagree."""
    i = g.index
    out: dict[str, tuple[str, str]] = {}
    if g.unknown:
        out["gpu_unknown"] = ("gpu_unknown", f"GPU {i} unknown: {g.error or 'NVML did not answer'}")
        return out
    if g.lost:
        return out
    if g.row_remap_failed:
        out["row_remap_failed"] = ("row_remap_failed", f"GPU {i}: row remapping failed")
    if g.row_remap_pending:
        out["row_remap_pending"] = (
            "row_remap_pending",
            f"GPU {i}: row remap pending, needs a GPU reset",
        )
    if g.retired_pages_pending:
        out["retired_pages_pending"] = (
            "retired_pages_pending",
            f"GPU {i}: page retirement pending, needs a GPU reset",
        )
    retired = (g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
    if retired >= RETIRED_PAGES_LIMIT:
        out["retired_pages_limit"] = (
            "retired_pages_limit",
            f"GPU {i}: {retired} retired pages (limit {RETIRED_PAGES_LIMIT})",
        )
    state, status = g.fabric_state, g.fabric_status
    if state == "completed" and status not in (None, 0):
        out["fabric_failed"] = (
            "fabric_failed",
            f"GPU {i}: NVLink fabric registration failed (nvmlReturn {status})",
        )
    elif state in ("not_started", "in_progress"):
        out["fabric_not_ready"] = ("fabric_not_ready", f"GPU {i}: NVLink fabric {state}")
    for link in g.nvlinks:
        if not link.active:
            out[f"nvlink_down:{link.link}"] = ("nvlink_down", f"GPU {i}: NVLink {link.link} down")
    return out


__all__ = [
    "RETIRED_PAGES_LIMIT",
    "RULES",
    "HwFinding",
    "HwRules",
    "Level",
    "hw_incident_key",
    "standing_conditions",
]
