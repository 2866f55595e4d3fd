"""Incident kind -> its evidence model, and the tolerant parse of a stored row (issue 13).

One table for every reader: the API schema builds its per-kind incident shapes from it
(``controller.schemas``); the loader and the incident service parse a stored ``evidence``
with :func:`parse_evidence` (memory holds every incident's evidence typed), the API and
the CLI read a row with :func:`read_evidence`, which validates it once. A kind not in the
table (another service's, a newer release's) keeps its evidence as stored
(:class:`UntypedEvidence`); so does a row that does not fit its kind's model (hand-edited,
or a release that broke its shape), with a warning, never an error: an incident is never
hidden because its evidence is odd.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from controller.logic.detection.c4d.job_evidence import (
    CommFailureEvidence,
    CommSlowEvidence,
    HangEvidence,
    LegacyStragglerEvidence,
    NonfiniteEvidence,
    RankCrashEvidence,
    SlowLinkEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.incident_evidence import (
    DegradedEvidence,
    GpuFaultEvidence,
    GpuWatchEvidence,
    HwEvidence,
    IncidentEvidence,
    NodeLostEvidence,
    PowerEvidence,
    QuarantineBudgetEvidence,
    RestartRefusedEvidence,
    UntypedEvidence,
    XidEvidence,
)

log = logging.getLogger(__name__)

#: A straggler row of today's shape, else of the shape written before peer groups.
StragglerAnyEvidence = Annotated[
    StragglerIncidentEvidence | LegacyStragglerEvidence, Field(union_mode="left_to_right")
]

#: Evidence model -> the incident kinds whose evidence it is (a model is one API shape).
KINDS_BY_EVIDENCE: dict[Any, tuple[str, ...]] = {
    GpuFaultEvidence: ("gpu_fault",),
    GpuWatchEvidence: ("gpu_watch_failed", "gpu_unreachable"),
    NodeLostEvidence: ("node_lost",),
    XidEvidence: ("application_xid", "gpu_xid"),
    HwEvidence: ("hw_degraded", "nic_errors"),
    DegradedEvidence: ("gpu_degraded",),
    PowerEvidence: (
        "power_brake",
        "power_telemetry_stale",
        "power_clock_command_failed",
        "power_limit_command_failed",
    ),
    QuarantineBudgetEvidence: ("quarantine_budget",),
    RestartRefusedEvidence: ("restart_refused",),
    HangEvidence: ("hang", "comm_hang"),
    RankCrashEvidence: ("rank_crash",),
    CommFailureEvidence: ("comm_failure",),
    NonfiniteEvidence: ("nonfinite",),
    CommSlowEvidence: ("comm_slow",),
    SlowLinkEvidence: ("slow_link",),
    StragglerAnyEvidence: ("straggler",),
}

#: Incident kind -> its evidence type (a model, or the straggler's union of two shapes).
EVIDENCE_BY_KIND: dict[str, Any] = {
    kind: model for model, kinds in KINDS_BY_EVIDENCE.items() for kind in kinds
}

_ADAPTERS: dict[str, TypeAdapter[IncidentEvidence]] = {
    kind: TypeAdapter(model) for kind, model in EVIDENCE_BY_KIND.items()
}


def read_evidence(kind: str, data: object) -> tuple[IncidentEvidence | None, str | None]:
    """``data`` through ``kind``'s model, validated once: ``(evidence, None)`` when it fits,
    ``(None, why)`` in one line when it does not, ``(None, None)`` for a kind without a
    model. The one validation every reader below goes through."""
    adapter = _ADAPTERS.get(kind)
    if adapter is None:
        return None, None
    try:
        return adapter.validate_python(data), None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "evidence"
        return None, f"{where}: {first['msg']}"


def evidence_error(kind: str, data: object) -> str | None:
    """Why ``data`` does not fit ``kind``'s model, in one line (``None``: it fits, or the
    kind has no model)."""
    return read_evidence(kind, data)[1]


def typed_evidence(kind: str, data: object) -> IncidentEvidence | None:
    """``data`` as ``kind``'s model, or ``None`` (no model, or it does not fit), silently:
    for a reader that shows the raw object instead (the CLI)."""
    return read_evidence(kind, data)[0]


def parse_evidence(kind: str, data: object) -> IncidentEvidence:
    """``data`` as ``kind``'s model; a kind without one, or a row that does not fit it (an
    older or damaged row), is kept as stored in :class:`UntypedEvidence` (a misfit is
    logged, never raised): memory reads every incident's evidence typed."""
    evidence, error = read_evidence(kind, data)
    if evidence is not None:
        return evidence
    if error is not None:
        log.warning(
            "incident evidence does not fit its kind's model; kept as stored",
            extra={"fields": {"kind": kind, "error": error}},
        )
    return UntypedEvidence.of(data)


__all__ = [
    "EVIDENCE_BY_KIND",
    "KINDS_BY_EVIDENCE",
    "StragglerAnyEvidence",
    "evidence_error",
    "parse_evidence",
    "read_evidence",
    "typed_evidence",
]
