"""What a job detector concludes, before the incident engine decides what to do with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from controller.logic.detection.c4d.job_evidence import JobEvidence
from controller.logic.incident_kinds import IncidentKind


class FindingKind(StrEnum):
    """The incident kinds the job detectors find (spelled once, in :class:`IncidentKind`)."""

    #: Some ranks entered a collective that others never reached: the absentees are hung
    #: outside communication (compute, data loading, a dead GPU).
    HANG = IncidentKind.HANG.value
    #: Every member entered and none finished: the communication path is at fault.
    COMM_HANG = IncidentKind.COMM_HANG.value
    #: One rank persistently computes longer while waiting less: non-communication slow.
    STRAGGLER = IncidentKind.STRAGGLER.value
    #: Job-wide collective wait rose beyond what compute explains: communication slow.
    COMM_SLOW = IncidentKind.COMM_SLOW.value
    #: A probe round named the slow link, rank or node.
    SLOW_LINK = IncidentKind.SLOW_LINK.value
    #: A rank process exited with an error or a signal (not because a peer died).
    RANK_CRASH = IncidentKind.RANK_CRASH.value
    #: Ranks died inside collectives with no rank crashing on its own: the network failed.
    COMM_FAILURE = IncidentKind.COMM_FAILURE.value
    #: A rank's input to a reduction held NaN/Inf before the reduction spread it: the rank
    #: (its GPU, its data shard) that produced it.
    NONFINITE = IncidentKind.NONFINITE.value


Severity = Literal["critical", "warning", "info"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    kind: FindingKind
    job: str
    severity: Severity
    summary: str
    #: Same key while the same condition persists; the incident engine updates the open
    #: incident with this key instead of opening another.
    key: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    #: The kind's evidence model (:mod:`.job_evidence`), the one the API schema serves: the
    #: job detection service adds what it knows (``nodes``, GPU cause, NIC suspects) and
    #: stores ``as_json()``. Empty on a resolution.
    evidence: JobEvidence = field(default_factory=JobEvidence)
    #: Rank pairs a link probe should time to localize the fault (empty: none needed).
    probe_pairs: tuple[tuple[int, int], ...] = ()
    #: True when the condition has cleared and an open incident with ``key`` may resolve.
    resolved: bool = False
    #: A newer reading of a condition already reported (same key): the open incident's
    #: summary and evidence are brought up to date instead of counting a new occurrence.
    refresh: bool = False
