"""Public API shapes (what clients see), kept apart from database rows.

Every list endpoint answers ``{"data": [...], "count": N}`` where ``count`` is the total
matching the filter and ``data`` is one page of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    computed_field,
    create_model,
)

from controller.logic.detection.evidence_kinds import KINDS_BY_EVIDENCE
from controller.logic.remediation.params import (
    PARAMS_BY_KIND,
    ActionKind,
    AlertParams,
    CaptureParams,
    CheckpointParams,
    IsolateParams,
    RestartParams,
    SkipParams,
)
from trainguard import wire

NodeHealth = Literal["healthy", "unhealthy", "lost", "unknown"]
GpuHealth = Literal["healthy", "unhealthy", "lost"]
CommandStatusPublic = Literal["pending", "sent", "succeeded", "failed", "relayed", "expired"]


class PublicModel(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class GpuPublic(PublicModel):
    index: int
    uuid: str
    name: str
    health: GpuHealth
    health_reason: str
    latest: wire.GpuSample | None


class GpuHistoryPoint(PublicModel):
    gpu_index: int
    start_unix_s: float
    end_unix_s: float
    samples: int
    power_w_avg: float | None
    power_w_max: float | None
    temperature_c_max: float | None
    sm_clock_mhz_avg: float | None
    utilization_gpu_pct_avg: float | None
    memory_used_bytes_max: int | None
    ecc_corrected_total: int | None
    ecc_uncorrected_total: int | None
    throttle_reasons_mask: int


class NodePublic(PublicModel):
    name: str
    hostname: str
    health: NodeHealth
    health_reason: str
    labels: dict[str, str]
    backend: str
    agent_version: str
    gpu_count: int
    gpus_unhealthy: int
    power_w: float | None
    last_report_unix_s: float | None
    first_seen_unix_s: float
    open_incidents: int
    #: Why the remediation engine keeps work off the node; ``None`` while it may be used.
    isolated_reason: str | None = None
    isolated_unix_s: float | None = None


class NodeDetail(NodePublic):
    gpus: list[GpuPublic]
    history: list[GpuHistoryPoint]


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int


class RankPublic(PublicModel):
    rank: int
    node: str
    gpu_index: int | None
    pid: int | None
    state: str
    last_step: int | None
    last_seen_unix_s: float


class JobPublic(PublicModel):
    name: str
    state: Literal["running", "degraded", "stopped", "unknown", "ended"] = Field(
        description="``ended``: a job the controller no longer holds in memory "
        "(``job_retention_s``), read back from the database (``source: history``)"
    )
    source: Literal["live", "history"] = Field(
        default="live",
        description="``live``: from the controller's memory, fresh; ``history``: from the "
        "database rows a job that left memory keeps (as they were last written)",
    )
    world_size: int
    ranks_reporting: int
    nodes: list[str]
    last_step: int | None
    first_seen_unix_s: float
    last_seen_unix_s: float
    open_incidents: int


class JobDetail(JobPublic):
    ranks: list[RankPublic]


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class _IncidentPublicBase(PublicModel):
    id: int
    kind: str
    severity: Literal["critical", "warning", "info"]
    state: Literal["open", "resolved"]
    summary: str
    node: str | None
    gpu_index: int | None
    job: str | None
    ranks: list[int]
    evidence: dict[str, Any]
    count: int = Field(description="Occurrences folded into this incident")
    opened_unix_s: float = Field(description="First seen")
    updated_unix_s: float = Field(description="Last seen: the latest occurrence folded in")
    resolved_unix_s: float | None


class OtherIncidentPublic(_IncidentPublicBase):
    """An incident whose evidence has no model: a kind this release does not type (another
    service's, a newer release's), or a row whose evidence does not fit its kind's model.

    ``evidence_error`` (always present, ``null`` for an untyped kind) keeps the schema's
    ``oneOf`` exclusive: no typed incident carries it."""

    evidence_error: str | None = Field(
        description="Why the evidence does not fit its kind's model (null: the kind has none)"
    )


def _typed_incident(evidence: Any, kinds: tuple[str, ...]) -> type[_IncidentPublicBase]:
    """The incident shape of ``kinds``: the shared fields, ``evidence`` as their model."""
    # A model names its shape; the one union of two models (StragglerAnyEvidence) is the
    # straggler's.
    name = evidence.__name__ if isinstance(evidence, type) else "StragglerEvidence"
    name = name.removesuffix("Evidence")
    model: type[_IncidentPublicBase] = create_model(
        f"{name}IncidentPublic",
        __base__=_IncidentPublicBase,
        __doc__=f"An incident of kind {', '.join(kinds)}, its evidence typed.",
        kind=(Literal[kinds], ...),  # type: ignore[arg-type]  # the kinds of the table
        evidence=(evidence, ...),
    )
    return model


#: One incident shape per evidence model (``controller.logic.detection.evidence_kinds``:
#: the one table of kinds and models), and the untyped one.
_TYPED_INCIDENTS = {
    kinds: _typed_incident(evidence, kinds) for evidence, kinds in KINDS_BY_EVIDENCE.items()
}
_INCIDENT_TAG = {kind: "|".join(kinds) for kinds in _TYPED_INCIDENTS for kind in kinds}


def _incident_tag(value: Any) -> str:
    """The typed shape of the incident's kind, or ``other``: a kind without a model, or
    evidence that does not fit its model (``evidence_error`` says why)."""
    if isinstance(value, dict):
        kind, error = value.get("kind"), value.get("evidence_error")
    else:
        kind, error = getattr(value, "kind", None), getattr(value, "evidence_error", None)
    if error is not None or not isinstance(kind, str):
        return "other"
    return _INCIDENT_TAG.get(kind, "other")


if TYPE_CHECKING:
    IncidentPublic: TypeAlias = _IncidentPublicBase
else:
    #: One incident, its ``evidence`` typed by its ``kind``. Validate rows with
    #: :data:`INCIDENT_ADAPTER` (through :func:`controller.services.queries.incident_public`).
    IncidentPublic = Annotated[
        Union[
            (
                *(Annotated[m, Tag("|".join(k))] for k, m in _TYPED_INCIDENTS.items()),
                Annotated[OtherIncidentPublic, Tag("other")],
            )
        ],
        Discriminator(_incident_tag),
    ]
INCIDENT_ADAPTER: TypeAdapter[IncidentPublic] = TypeAdapter(IncidentPublic)


class IncidentsPublic(BaseModel):
    data: list[IncidentPublic]
    count: int


class _ActionPublicBase(PublicModel):
    id: int
    target: str
    trigger: str
    status: Literal["pending", "succeeded", "failed", "dry_run", "skipped"]
    outcome: str
    created_unix_s: float
    finished_unix_s: float | None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def duration_s(self) -> float | None:
        """How long the action took (``None`` while it runs)."""
        if self.finished_unix_s is None:
            return None
        return max(0.0, self.finished_unix_s - self.created_unix_s)


class AlertActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.ALERT]
    params: AlertParams


class SkipActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.SKIP]
    params: SkipParams


class CaptureActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.CAPTURE_EVIDENCE]
    params: CaptureParams


class CheckpointActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.CHECKPOINT]
    params: CheckpointParams


class IsolateActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.ISOLATE_NODE]
    params: IsolateParams


class RestartActionPublic(_ActionPublicBase):
    kind: Literal[ActionKind.RESTART_JOB]
    params: RestartParams


class OtherActionPublic(_ActionPublicBase):
    """An action of another service (power, traffic, policy changes): params as stored."""

    #: Not one of the typed kinds: keeps the schema's ``oneOf`` exclusive.
    kind: str = Field(json_schema_extra={"not": {"enum": [k.value for k in ActionKind]}})
    params: dict[str, Any]


def _action_tag(value: Any) -> str:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) and kind in PARAMS_BY_KIND else "other"


#: One action row, its ``params`` typed by its ``kind`` (the remediation engine's kinds;
#: others are plain objects). Validate rows with :data:`ACTION_ADAPTER`.
ActionPublic = Annotated[
    Annotated[AlertActionPublic, Tag(ActionKind.ALERT)]
    | Annotated[SkipActionPublic, Tag(ActionKind.SKIP)]
    | Annotated[CaptureActionPublic, Tag(ActionKind.CAPTURE_EVIDENCE)]
    | Annotated[CheckpointActionPublic, Tag(ActionKind.CHECKPOINT)]
    | Annotated[IsolateActionPublic, Tag(ActionKind.ISOLATE_NODE)]
    | Annotated[RestartActionPublic, Tag(ActionKind.RESTART_JOB)]
    | Annotated[OtherActionPublic, Tag("other")],
    Discriminator(_action_tag),
]
ACTION_ADAPTER: TypeAdapter[ActionPublic] = TypeAdapter(ActionPublic)


class ActionsPublic(BaseModel):
    data: list[ActionPublic]
    count: int


class CommandPublic(PublicModel):
    id: str
    node: str
    kind: str
    params: dict[str, Any]
    status: CommandStatusPublic
    reason: str
    created_unix_s: float
    sent_unix_s: float | None
    finished_unix_s: float | None


class CommandsPublic(BaseModel):
    data: list[CommandPublic]
    count: int


class StatusPublic(BaseModel):
    version: str
    database: Literal["sqlite", "postgresql"]
    #: This replica holds the leader lock (a standby's other numbers are empty).
    leader: bool = True
    nodes_total: int
    nodes_by_health: dict[str, int]
    gpus_total: int
    gpus_unhealthy: int
    jobs_total: int
    incidents_open: int
    incidents_open_by_kind: dict[str, int]
    reports_total: int
    uptime_s: float


class HealthzPublic(BaseModel):
    status: Literal["ok", "writer_stopped"]


class ReadyzPublic(BaseModel):
    status: Literal["ready", "not_ready"]
    detail: str = ""


class ErrorPublic(BaseModel):
    detail: str


# ---------------------------------------------------------------------- command requests
# A wire.Command without ``id``: the server assigns ids (and ``issued_unix_s``).

_NO_ID = Field(default=None, description="Ignored: the server assigns the id")


class SetPowerLimitRequest(wire.SetPowerLimit):
    id: str | None = _NO_ID  # type: ignore[assignment]


class ResetPowerLimitRequest(wire.ResetPowerLimit):
    id: str | None = _NO_ID  # type: ignore[assignment]


class LockClocksRequest(wire.LockClocks):
    id: str | None = _NO_ID  # type: ignore[assignment]


class UnlockClocksRequest(wire.UnlockClocks):
    id: str | None = _NO_ID  # type: ignore[assignment]


class JobCheckpointRequest(wire.JobCheckpoint):
    id: str | None = _NO_ID  # type: ignore[assignment]


class JobLinkProbeRequest(wire.JobLinkProbe):
    id: str | None = _NO_ID  # type: ignore[assignment]


class JobStopRequest(wire.JobStop):
    id: str | None = _NO_ID  # type: ignore[assignment]


CommandRequest = Annotated[
    SetPowerLimitRequest
    | ResetPowerLimitRequest
    | LockClocksRequest
    | UnlockClocksRequest
    | JobCheckpointRequest
    | JobLinkProbeRequest
    | JobStopRequest,
    Field(discriminator="kind"),
]
