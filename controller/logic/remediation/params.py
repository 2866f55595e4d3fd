"""Typed parameters of the remediation engine's action rows, one model per action kind.

The steps build these models, :func:`parse_params` reads a stored row back into one, the API
schema (``ActionPublic``, a union discriminated by ``kind``) and the CLI's action views
use them: one definition of each field. Stored as JSON in ``actions.params`` exactly as
before (field names and nesting unchanged, only the fields given: :meth:`ActionParams.
to_params`); unknown keys of an older or newer release are kept, not dropped.

A restart's row carries what the goodput ledger needs to be rebuilt by a new leader
(:func:`~controller.services.remediation.history.replay`): the writer (the ``restart`` step
and the resume wait) and the reader build and parse the same model, so a field renamed on
one side is a type error, not a ledger that silently stops being rebuilt. Stored as JSON in
``actions.params["goodput"]``; the API and CLI show it as part of ``params``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import ConfigDict

from controller.logic.given import OnlyGiven


class _OnlyGiven(OnlyGiven):
    """Serializes the fields a row holds, no defaults added (:class:`OnlyGiven`)."""

    def to_params(self) -> dict[str, Any]:
        """The JSON the action row stores: the fields given, no others."""
        return self.model_dump(mode="json")


class GoodputFacts(_OnlyGiven):
    """What one restart cost its job, as the goodput ledger was told."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: The ledger's name for the incident (its id, or ``grow:<remediation>``).
    ledger_id: str
    #: The incident kind, or ``grow`` for a grow-back.
    kind: str
    fault_unix_s: float
    detected_unix_s: float
    #: The newest step reached before the restart, and the checkpoint step resumed from.
    last_step: int
    resume_step: int
    #: Median healthy step time when the restart began (``None``: not known yet).
    step_s: float | None
    #: Added when the job steps again (the resume wait).
    restart_unix_s: float | None = None
    resumed_unix_s: float | None = None

    def resumed(self, *, restart_unix_s: float | None, resumed_unix_s: float) -> GoodputFacts:
        return self.model_validate(
            self.to_params() | {"restart_unix_s": restart_unix_s, "resumed_unix_s": resumed_unix_s}
        )


class ActionKind(StrEnum):
    """The action kinds the remediation engine records (other services add their own)."""

    ALERT = "alert"
    SKIP = "skip"
    CAPTURE_EVIDENCE = "capture_evidence"
    CHECKPOINT = "checkpoint"
    ISOLATE_NODE = "isolate_node"
    #: ``restart``, ``rollback`` (with :attr:`RestartParams.rollback`) and a grow-back.
    RESTART_JOB = "restart_job"


class PlanKind(StrEnum):
    """How a restart places the job (:mod:`controller.logic.remediation.planner`)."""

    SAME_SIZE = "same_size"
    SHRINK = "shrink"
    GROW = "grow"
    REFUSED = "refused"


class Severity(StrEnum):
    WARNING = "warning"
    CRITICAL = "critical"
    INFO = "info"


class ActionParams(_OnlyGiven):
    """What every remediation row carries: what triggered it, and for which job."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: The triggering incident (absent for a grow-back).
    incident: int | None = None
    incident_kind: str | None = None
    #: The remediation the row belongs to, and its job (a new leader resumes from them).
    remediation: str | None = None
    job: str | None = None


class AlertParams(ActionParams):
    severity: Severity | None = None
    #: The rule's steps that follow if the incident persists.
    then: list[str] = []


class SkipParams(ActionParams):
    """An incident decided not to be acted on (the row's outcome says why)."""


class CapturedCall(_OnlyGiven):
    model_config = ConfigDict(extra="allow", frozen=True)

    op: str
    seq: int
    group: str | None = None


class CapturedRank(_OnlyGiven):
    model_config = ConfigDict(extra="allow", frozen=True)

    rank: int
    node: str | None = None
    state: str | None = None
    last_step: int | None = None
    inflight: list[CapturedCall] = []


class CaptureParams(ActionParams):
    ranks: list[CapturedRank] = []


class CheckpointParams(ActionParams):
    nodes: list[str] = []
    #: The newest committed step before the request (the new one must pass it).
    before_step: int | None = None


class IsolateParams(ActionParams):
    actuator: str | None = None


class RollbackFacts(_OnlyGiven):
    model_config = ConfigDict(extra="allow", frozen=True)

    #: Where NaN/Inf first appeared: the rollback resumes from a checkpoint before it.
    bad_step: int | None = None


class RestartParams(ActionParams):
    plan: PlanKind | None = None
    reason: str | None = None
    from_nodes: list[str] | None = None
    from_world_size: int | None = None
    original_nodes: int | None = None
    resume_step: int | None = None
    nodes: list[str] | None = None
    world_size: int | None = None
    tp: int | None = None
    dp: int | None = None
    generation: int | None = None
    goodput: GoodputFacts | None = None
    #: The first step of the new generation (written by the resume wait).
    resumed_step: int | None = None
    rollback: RollbackFacts | None = None


PARAMS_BY_KIND: dict[str, type[ActionParams]] = {
    ActionKind.ALERT: AlertParams,
    ActionKind.SKIP: SkipParams,
    ActionKind.CAPTURE_EVIDENCE: CaptureParams,
    ActionKind.CHECKPOINT: CheckpointParams,
    ActionKind.ISOLATE_NODE: IsolateParams,
    ActionKind.RESTART_JOB: RestartParams,
}


def parse_params(kind: str, raw: Any) -> ActionParams | dict[str, Any]:
    """A stored row's params as its kind's model (``pydantic.ValidationError`` if the row
    does not fit it); kinds of other services stay plain JSON objects."""
    model = PARAMS_BY_KIND.get(kind)
    if model is None:
        return dict(raw or {})
    return model.model_validate(raw or {})


__all__ = [
    "PARAMS_BY_KIND",
    "ActionKind",
    "ActionParams",
    "AlertParams",
    "CaptureParams",
    "CapturedCall",
    "CapturedRank",
    "CheckpointParams",
    "GoodputFacts",
    "IsolateParams",
    "PlanKind",
    "RestartParams",
    "RollbackFacts",
    "Severity",
    "SkipParams",
    "parse_params",
]
