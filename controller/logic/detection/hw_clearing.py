"""When a GPU's ``hw_degraded`` warning resolves itself: its standing conditions cleared.

Pure: reports and the open incident's recorded signals in, decisions out; no I/O, no clock.
The health detector (``controller.services.detection.hw_clear``) feeds it and resolves.

The rule (docs/detection.md, "Hardware warnings that clear", is the operators' version):

* Only a GPU's warning whose every recorded signal is a *standing* condition, one each
  sample states afresh (:data:`STANDING_SIGNALS`), resolves itself. Edge events
  (``pcie_link_degraded``, NIC ports, NICs gone, bond members) arrive once, as events, and
  no sample says they are over: a warning that recorded one stays for a person, as do
  NIC-keyed warnings (they are not keyed by GPU at all).
* The decision rests on the open incident plus the samples, never on a memo alone: a new
  leader (memory empty) resolves a warning it loaded from the database the same way.
* A report *counts as clear* for a GPU when every sample of it that has the GPU reads it
  (not ``unknown``, ``lost`` or ``unreachable``), no degrade-level standing condition stands
  in any of them, and each signal the warning recorded was actually read (a field NVML did
  not answer is ``None``: unknown, not cleared). Unknown, lost or unreachable samples say
  nothing of the GPU's other conditions (``gpu_unknown`` itself then stands): they restart
  the count. A report without the GPU leaves the count as it was.
* The warning resolves after :data:`CLEAR_AFTER_REPORTS` clear reports in a row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from controller.logic.detection.hw_rules import RULES, hw_incident_key, standing_conditions
from controller.logic.detection.incident_evidence import HwEvidence, IncidentEvidence
from controller.logic.incident_kinds import IncidentKind
from trainguard import wire

#: Clear reports in a row before a GPU's warning resolves. One is not enough: a flapping
#: NVLink would open, resolve and open again every report (a page each time, and a history
#: no one can read). Three reports are ~15 s at the agent's default 5 s interval, every
#: sample of them clear: short enough that a recovered GPU does not show a stale warning,
#: long enough that a link bouncing every few seconds keeps its one open warning.
CLEAR_AFTER_REPORTS = 3

#: Degrade-level signals that each sample states afresh, and how to tell it was read (a
#: ``None`` field is a read NVML did not answer). ``nvlink_down``: healthy links are left
#: out of the wire, so "link absent" means "up" only when every link's state was read,
#: which ``nvlink_active_count`` says (``None`` when one failed).
_READ: dict[str, Callable[[wire.GpuSample], bool]] = {
    "gpu_unknown": lambda g: True,  # a sample that is not ``unknown`` answered
    "row_remap_pending": lambda g: g.row_remap_pending is not None,
    "retired_pages_pending": lambda g: g.retired_pages_pending is not None,
    "nvlink_down": lambda g: g.nvlink_active_count is not None,
    "fabric_not_ready": lambda g: g.fabric_state is not None,
}

#: The ``hw_degraded`` signals a GPU's samples can show cleared.
STANDING_SIGNALS: frozenset[str] = frozenset(_READ)

#: What an operator reads for each cleared signal (NVLinks are named by number apart).
_CLEARED: dict[str, str] = {
    "gpu_unknown": "NVML answers again",
    "row_remap_pending": "row remap no longer pending",
    "retired_pages_pending": "page retirement no longer pending",
    "fabric_not_ready": "NVLink fabric registration completed",
}

Verdict = Literal["clear", "standing", "unread"]


def hw_degraded_key(node: str, gpu_index: int) -> str:
    """The dedupe key of a GPU's ``hw_degraded`` warning (as the health detector opens it)."""
    return hw_incident_key(IncidentKind.HW_DEGRADED, node, gpu_index)


def incident_signals(evidence: IncidentEvidence) -> frozenset[str] | None:
    """The hardware signals an open warning recorded (first one and every event's), or
    ``None`` for evidence that is not a hardware rule's (hand-edited, another release)."""
    if not isinstance(evidence, HwEvidence):
        return None
    return frozenset({evidence.signal, *(e.signal for e in evidence.events or () if e.signal)})


def self_clearing(signals: Collection[str] | None) -> bool:
    """Whether a warning with these recorded signals may resolve itself: all standing."""
    return bool(signals) and STANDING_SIGNALS.issuperset(signals or ())


def degrade_flags(g: wire.GpuSample) -> frozenset[str]:
    """The degrade-level standing flags of one sample (``nvlink_down:7``, ...)."""
    return frozenset(
        flag
        for flag, (signal, _) in standing_conditions(g).items()
        if RULES[signal][0] == "degrade"
    )


def gpu_verdict(g: wire.GpuSample, signals: Collection[str]) -> Verdict:
    """One sample of a GPU whose warning recorded ``signals``: does it show them cleared?"""
    if g.unknown:
        return "standing"  # gpu_unknown itself; the rest was not read
    if g.lost or g.unreachable:
        return "unread"
    if degrade_flags(g):
        return "standing"
    return "clear" if all(_READ[s](g) for s in signals if s in _READ) else "unread"


def clear_note(gpu_index: int, signals: Collection[str], flags: Collection[str]) -> str:
    """Why the warning resolved: what cleared, and that nothing degraded stands.

    ``flags`` are the standing flags seen while the warning was open (they name the
    links); after a leader change they may be empty and ``signals`` alone say what."""
    names = {*signals, *(f.split(":", 1)[0] for f in flags)}
    links = sorted(int(f.split(":", 1)[1]) for f in flags if f.startswith("nvlink_down:"))
    first = ("gpu_unknown", "row_remap_pending", "retired_pages_pending")
    parts = [_CLEARED[s] for s in first if s in names]
    if links:
        plural = "s" if len(links) > 1 else ""
        parts.append(f"NVLink{plural} {', '.join(map(str, links))} up again")
    elif "nvlink_down" in names:
        parts.append("NVLinks up again")
    if "fabric_not_ready" in names:
        parts.append(_CLEARED["fabric_not_ready"])
    parts.append(f"no degraded condition stands on GPU {gpu_index}")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class Cleared:
    """A GPU whose warning may resolve now, and the note that says why."""

    node: str
    gpu_index: int
    note: str


@dataclass(slots=True)
class _Track:
    #: Clear reports in a row.
    streak: int = 0
    #: Standing flags seen while the warning was open (for the note: which links).
    stood: set[str] = field(default_factory=set)


class HwClearing:
    """Counts clear reports per (node, GPU) with an open self-clearing warning.

    Only GPUs whose warning is open are tracked (the caller says which, from the open
    incidents): a node with none costs one dictionary look-up per report. The memo is a
    count and the links' names, never the judge of what stood: that is the warning's own
    record, so an empty memo (a new leader) only means counting from zero.
    """

    def __init__(self, after_reports: int = CLEAR_AFTER_REPORTS) -> None:
        self.after_reports = after_reports
        self._nodes: dict[str, dict[int, _Track]] = {}

    def observe(
        self, report: wire.Report, open_signals: Mapping[int, Collection[str]]
    ) -> list[Cleared]:
        """Count this report; ``open_signals``: GPU -> signals of its open warning (only
        GPUs with one). Returns the GPUs whose warning may resolve, again on every report
        until it is (a resolution the database refused is retried)."""
        node = report.node.name
        wanted = {i: s for i, s in open_signals.items() if self_clearing(s)}
        tracks = self._nodes.get(node)
        if not wanted:
            self._nodes.pop(node, None)
            return []
        if tracks is None:
            tracks = self._nodes[node] = {}
        for index in [i for i in tracks if i not in wanted]:
            del tracks[index]  # resolved (by us or a person) or no longer ours to judge
        verdicts: dict[int, Verdict] = {}
        for sample in report.samples:
            for g in sample.gpus:
                signals = wanted.get(g.index)
                if signals is None or verdicts.get(g.index) == "standing":
                    continue
                verdict = gpu_verdict(g, signals)
                if verdict == "standing":
                    tracks.setdefault(g.index, _Track()).stood.update(degrade_flags(g))
                    if g.unknown:
                        tracks[g.index].stood.add("gpu_unknown")
                if verdict != "clear" or g.index not in verdicts:
                    verdicts[g.index] = verdict
        out: list[Cleared] = []
        for index, verdict in sorted(verdicts.items()):
            track = tracks.setdefault(index, _Track())
            if verdict != "clear":
                track.streak = 0
                continue
            track.streak += 1
            if track.streak >= self.after_reports:
                note = clear_note(index, wanted[index], track.stood)
                out.append(Cleared(node, index, f"{note} for {track.streak} reports"))
        return out


__all__ = [
    "CLEAR_AFTER_REPORTS",
    "STANDING_SIGNALS",
    "Cleared",
    "HwClearing",
    "Verdict",
    "clear_note",
    "degrade_flags",
    "gpu_verdict",
    "hw_degraded_key",
    "incident_signals",
    "self_clearing",
]
