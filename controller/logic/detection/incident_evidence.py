"""Typed incident evidence (issue 13): the shared base, and the evidence of node-side incidents.

Every incident's ``evidence`` JSON has a model, one per kind: node health and degraded GPUs
(here), power, the quarantine budget and refused restarts (here too: they are incidents like
the others, and one module of evidence is easier to find than one per service), and the job
detectors' kinds (:mod:`controller.logic.detection.c4d.job_evidence`). The producers build
these models and store ``as_json()``; the API schema (``controller.schemas.IncidentPublic``),
the CLI and the dashboard read the same fields; :mod:`controller.logic.detection.evidence_kinds`
maps each kind to its model and parses a stored row.

The stored JSON keeps the shape it always had, so rows written before these models existed
load unchanged: every model allows keys it does not know (written by a newer controller),
fields added after a kind was introduced have defaults, and a model dumps only the fields a
row holds (:class:`~controller.logic.given.OnlyGiven`).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_serializer

from controller.logic.given import OnlyGiven


class EvidenceEvent(OnlyGiven):
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
    #: Degraded GPUs: ``ecc`` or ``throttle``, and that cause's reading.
    cause: str | None = None
    rise: int | None = None
    ecc_corrected_total: int | None = None
    reasons: list[str] | None = None
    throttled_fraction: float | None = None
    temperature_c: float | None = None
    max_temperature_c: float | None = None
    #: Power incidents: the policy's message.
    message: str | None = None


class IncidentEvidence(OnlyGiven):
    """Common to every typed evidence: the folded occurrences and the resolution note."""

    model_config = ConfigDict(extra="allow")

    events: list[EvidenceEvent] | None = None
    #: Why it was resolved (set by the incident service on resolution).
    resolution: str | None = None

    #: The fields a one-line view shows (the CLI's EVIDENCE column), most telling first.
    BRIEF: ClassVar[tuple[str, ...]] = ()

    def as_json(self) -> dict[str, Any]:
        """The stored JSON: only the fields that were set, as before the models existed."""
        return self.model_dump(mode="json")

    def brief(self) -> dict[str, Any]:
        """The :attr:`BRIEF` fields this evidence holds (not empty), in that order."""
        data = self.as_json()
        return {k: data[k] for k in self.BRIEF if data.get(k) not in (None, "", [], {})}


class UntypedEvidence(IncidentEvidence):
    """Evidence without a model to read it through: a kind this release does not type
    (another service's, a newer release's), or a stored row that does not fit its kind's
    model (hand-edited, or a release that broke its shape). It keeps the object as stored
    and gives it back unchanged; its typed fields stay unset (nothing in it is trusted), so
    a reader that looks for a kind's fields finds none, and the incident is still shown and
    acted on by kind."""

    #: The stored JSON: an object, but a hand-edited row may hold anything, kept as well.
    _stored: Any = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, data: object) -> Self:
        """``data`` kept as it is (a copy: never the caller's object)."""
        untyped = cls()
        untyped._stored = copy.deepcopy(data)
        return untyped

    @model_serializer(mode="plain")
    def _as_stored(self) -> Any:
        return copy.deepcopy(self._stored)

    def __repr_args__(self) -> list[tuple[str | None, Any]]:
        return [("stored", self._stored)]


class GpuFaultEvidence(IncidentEvidence):
    """``gpu_fault``: the reasons of the fault that opened it (fatal XID, ECC growth, lost)."""

    BRIEF = ("reasons",)

    reasons: list[str]


class GpuWatchEvidence(IncidentEvidence):
    """``gpu_watch_failed``: NVML's error on a node with NVIDIA devices; ``gpu_unreachable``:
    the error of a GPU none of whose NVML reads answers."""

    BRIEF = ("gpu_error",)

    gpu_error: str


class NodeLostEvidence(IncidentEvidence):
    """``node_lost``: when the agent last reported (controller clock)."""

    BRIEF = ("last_report_unix_s",)

    last_report_unix_s: float | None


class XidEvidence(IncidentEvidence):
    """``application_xid`` / ``gpu_xid``: how often each code was seen (codes as strings)."""

    BRIEF = ("codes",)

    codes: dict[str, int]


class HwEvidence(IncidentEvidence):
    """``hw_degraded`` / ``nic_errors``: the hardware rule's signal and the device."""

    BRIEF = ("signal", "device")

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

    BRIEF = ("causes",)

    causes: list[str]
    since_unix_s: float | None = None
    ecc: EccCause | None = None
    throttle: ThrottleCause | None = None


class PowerEvidence(IncidentEvidence):
    """``power_*``: the power domain, the policy's incident kind and the domain's numbers
    when the loop had a reading (budget, draw, level)."""

    BRIEF = ("domain", "policy_kind", "power_w", "budget_w")

    domain: str | None
    policy_kind: str
    budget_w: float | None = None
    power_w: float | None = None
    level: str | None = None


class QuarantineBudgetEvidence(IncidentEvidence):
    """``quarantine_budget``: the isolation refused, and the budget that refused it
    (``budget``: ``quarantine``, the controller's quarantine budget, or
    ``circuit_breaker``, the policy's ``guards.max_isolated_fraction``; rows written
    before the breaker raised it are the quarantine budget's)."""

    BRIEF = ("refused_node", "quarantined_in_window", "limit", "budget")

    refused_node: str
    quarantined_in_window: int
    limit: int
    fleet: int
    window_s: float
    budget: Literal["quarantine", "circuit_breaker"] = "quarantine"


class RestartRefusedEvidence(IncidentEvidence):
    """``restart_refused``: the job whose restart was refused, why (``why``: ``rate_limit``,
    ``actuator``, ``placement`` or ``checkpoint_deleted``; ``detail``: the refused
    ``restart_job`` row's outcome) and the incident the restart was for. One open incident
    per job, refreshed by each refusal: these fields are the newest one's, ``count`` says
    how many there were."""

    BRIEF = ("job", "why", "for_incident")

    job: str
    why: str
    detail: str
    for_incident: int | None = None
    for_incident_kind: str | None = None


__all__ = [
    "DegradedEvidence",
    "EccCause",
    "EvidenceEvent",
    "GpuFaultEvidence",
    "GpuWatchEvidence",
    "HwEvidence",
    "IncidentEvidence",
    "NodeLostEvidence",
    "PowerEvidence",
    "QuarantineBudgetEvidence",
    "RestartRefusedEvidence",
    "ThrottleCause",
    "UntypedEvidence",
    "XidEvidence",
]
