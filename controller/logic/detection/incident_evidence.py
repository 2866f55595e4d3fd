"""Typed evidence of the health and degraded-GPU incidents (issue 13), as the straggler's is.

The detectors (:mod:`controller.services.detection.health`, ``.degraded``) build these
models and store ``as_json()``; readers (the API, the CLI, the dashboard) parse a stored
``evidence`` with :func:`parse_evidence`. The stored JSON keeps the shape it always had, so
rows written before these models existed load unchanged: every model allows keys it does not
know (written by a newer controller, or added by the incident service: ``events``,
``resolution``), and a row that does not fit its kind's model is returned as the plain dict
it is, with a warning, never an error.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger(__name__)


class EvidenceEvent(BaseModel):
    """One occurrence folded into an incident (its ``events`` list keeps the newest 50)."""

    model_config = ConfigDict(extra="allow")

    #: When it happened, on the reporting node's clock.
    time_unix_s: float
    xid: int | None = None
    detail: str | None = None
    #: The GPU stopped answering the driver.
    lost: bool | None = None
    #: Uncorrectable ECC count now, and before the rise.
    ecc_uncorrected_total: int | None = None
    before: int | None = None
    #: The hardware rule's signal (``controller.logic.detection.hw_rules``).
    signal: str | None = None
    #: Degraded GPUs: ``ecc`` or ``throttle``.
    cause: str | None = None


class IncidentEvidence(BaseModel):
    """Common to every typed evidence: the folded occurrences and the resolution note."""

    model_config = ConfigDict(extra="allow")

    events: list[EvidenceEvent] | None = None
    #: Why it was resolved (set by the incident service on resolution).
    resolution: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The stored JSON: only the fields that were set, as before the models existed."""
        return self.model_dump(mode="json", exclude_unset=True)


class GpuFaultEvidence(IncidentEvidence):
    """``gpu_fault``: the reasons of the fault that opened it (fatal XID, ECC growth, lost)."""

    reasons: list[str]


class GpuWatchEvidence(IncidentEvidence):
    """``gpu_watch_failed``: NVML's error on a node with NVIDIA devices."""

    gpu_error: str


class NodeLostEvidence(IncidentEvidence):
    """``node_lost``: when the agent last reported (controller clock)."""

    last_report_unix_s: float | None


class XidEvidence(IncidentEvidence):
    """``application_xid`` / ``gpu_xid``: how often each code was seen (codes as strings)."""

    codes: dict[str, int]


class HwEvidence(IncidentEvidence):
    """``hw_degraded`` / ``nic_errors``: the hardware rule's signal and the device."""

    signal: str
    device: str | None = None


class EccCause(BaseModel):
    """Correctable ECC errors that rose by ``rise`` within ``window_s``."""

    model_config = ConfigDict(extra="allow")

    rise: int
    threshold: int
    window_s: float
    ecc_corrected_total: int | None
    since_unix_s: float


class ThrottleCause(BaseModel):
    """Hardware throttling in most samples for ``duration_s``."""

    model_config = ConfigDict(extra="allow")

    reasons: list[str]
    duration_s: float
    min_duration_s: float
    throttled_fraction: float
    temperature_c: float | None
    max_temperature_c: float | None
    since_unix_s: float


class DegradedEvidence(IncidentEvidence):
    """``gpu_degraded``: each active cause's numbers, and when the first one began."""

    causes: list[str]
    since_unix_s: float | None = None
    ecc: EccCause | None = None
    throttle: ThrottleCause | None = None


#: Incident kind -> its evidence model (kinds not here keep plain-dict evidence).
EVIDENCE_BY_KIND: dict[str, type[IncidentEvidence]] = {
    "gpu_fault": GpuFaultEvidence,
    "gpu_watch_failed": GpuWatchEvidence,
    "node_lost": NodeLostEvidence,
    "application_xid": XidEvidence,
    "gpu_xid": XidEvidence,
    "hw_degraded": HwEvidence,
    "nic_errors": HwEvidence,
    "gpu_degraded": DegradedEvidence,
}


def parse_evidence(kind: str, data: dict[str, Any]) -> IncidentEvidence | dict[str, Any]:
    """``data`` as ``kind``'s model; a kind without one, or a row that does not fit it (an
    older or damaged row), stays the dict it is (logged, never raised)."""
    model = EVIDENCE_BY_KIND.get(kind)
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        log.warning(
            "incident evidence does not fit its kind's model; shown as stored",
            extra={"fields": {"kind": kind, "error": str(exc).splitlines()[0]}},
        )
        return data


__all__ = [
    "EVIDENCE_BY_KIND",
    "DegradedEvidence",
    "EccCause",
    "EvidenceEvent",
    "GpuFaultEvidence",
    "GpuWatchEvidence",
    "HwEvidence",
    "IncidentEvidence",
    "NodeLostEvidence",
    "ThrottleCause",
    "XidEvidence",
    "parse_evidence",
]
