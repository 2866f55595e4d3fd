"""The remediation policy: declarative rules from incident kind and severity to actions.

Operators write the policy as YAML (``TRAINGUARD_POLICY_FILE``) or ``PUT`` it through the
API; both are validated strictly here, so a typo is a 422 or a refused start naming the
field, never a silently ignored rule. Rules are matched in order; the first rule whose kind
and severity match an incident decides what happens to it.

The defaults follow the C4 / MegaScale practice: a fatal GPU fault or a lost node is
isolated and the job restarted without it; a hang restarts the job (the culprit's node is
isolated only with hardware evidence or when it hangs again, because most hangs are
software); a straggler is alerted at once and escalated (checkpoint, isolate, restart) only
once it has persisted and costs enough throughput; rising correctable errors or throttling
ask for a protective checkpoint; NaN/Inf in a collective rolls the job back to the newest
checkpoint committed before it appeared.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from controller.logic.incident_kinds import unknown_kind_error

# Numbers finite (``allow_inf_nan=False`` on every model) and in range, strings without NUL.
from trainguard.limits import INT32_MAX, NO_NUL
from trainguard.textfile import Unparsable, Unreadable, load_yaml, read_text


class Step(StrEnum):
    """One thing the engine can do about an incident, in the order the rule lists them."""

    #: Record the incident as needing a human: an ``alert`` action at the rule's first match,
    #: once per incident, before ``after_s`` and ``min_cost_pct`` are waited for. Alone it
    #: acts on nothing; first in a longer list it is the warning that precedes escalation.
    ALERT = "alert"
    #: Keep what the job's in-flight collectives and ranks look like in the action record.
    CAPTURE_EVIDENCE = "capture_evidence"
    #: Ask every rank to checkpoint now and wait (bounded) until it is durable.
    CHECKPOINT = "checkpoint"
    #: Keep work off the culprit node (cordon + taint on Kubernetes).
    ISOLATE = "isolate"
    #: Stop the job and start it again without isolated nodes, from the newest checkpoint.
    RESTART = "restart"
    #: Like ``restart``, but from the newest checkpoint committed *before* the step the
    #: incident's evidence names (``evidence.step``: where NaN/Inf first appeared), so the
    #: job does not resume from a state that already carries the damage.
    ROLLBACK = "rollback"
    #: POST the incident and the remediation, signed, to the site's own URL
    #: (``remediation_webhook_url``): a ticketing or repair flow of its own
    #: (docs/remediation.md, "Webhook step"). Its answer is recorded; a failure does not
    #: stop the steps after it.
    WEBHOOK = "webhook"


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """What one job's own policy says (a Kubernetes workload's ``trainguard.io/policy``
    annotation): it narrows what the controller's rule does to *this* job.

    ``steps``: the steps run for this job instead of the rule's (the rule still decides
    whether and when to act); ``dry_run``: record the plan and wait for a human to approve
    it (``RemediationEngine.approve``); ``max_restarts``: applied by the actuator, which
    knows the workload's own restart count.
    """

    steps: tuple[str, ...] | None = None
    dry_run: bool = False
    max_restarts: int | None = None

    def step_list(self) -> list[Step] | None:
        """``steps`` as :class:`Step` (``alert`` dropped: it is the rule's), or ``None``.
        An unknown name is a one-line :class:`ValueError`."""
        if self.steps is None:
            return None
        known = {s.value for s in Step}
        unknown = [s for s in self.steps if s not in known]
        if unknown:
            raise ValueError(f"unknown step(s) {unknown}; known: {', '.join(sorted(known))}")
        return [Step(s) for s in self.steps if s != Step.ALERT]


class IsolateWhen(StrEnum):
    ALWAYS = "always"
    #: Only when the evidence names hardware (a GPU fault, throttling, ECC) on the node,
    #: or the same node was the culprit of an earlier incident within ``repeat_window_s``.
    HARDWARE_OR_REPEAT = "hardware_or_repeat"


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Incident kind (``gpu_fault``, ``node_lost``, ``hang``, ``comm_hang``, ``straggler``,
    #: ``comm_slow``, ``slow_link``, ``rank_crash``, ``comm_failure``, ``gpu_degraded``…;
    #: every one in :class:`~controller.logic.incident_kinds.IncidentKind`) or ``*`` for
    #: any. Another word is refused: a rule for it would never match.
    kind: str = Field(min_length=1, max_length=64, pattern=NO_NUL)
    #: Match incidents of this severity or worse (``warning`` matches both).
    severity: Literal["warning", "critical"] = "warning"
    steps: list[Step] = Field(min_length=1, max_length=8)
    #: Run the steps after ``alert`` only once the incident has been open this long
    #: (persistence window).
    after_s: float = Field(default=0.0, ge=0.0, le=86_400.0)
    #: Run the steps after ``alert`` only if the incident costs at least this share of job
    #: throughput (``evidence.slowdown_pct`` of a straggler); ``0`` always acts.
    min_cost_pct: float = Field(default=0.0, ge=0.0, le=100.0)
    #: Run the steps after ``alert`` only once the incident counts this many steps with the
    #: fault (``evidence.bad_steps`` of a ``nonfinite`` incident); ``0`` always acts. An
    #: fp16 overflow that dynamic loss scaling skips is one bad step, a diverged model is
    #: every step from then on.
    min_bad_steps: int = Field(default=0, ge=0, le=10_000)
    isolate_when: IsolateWhen = IsolateWhen.ALWAYS
    #: Shown with the policy; why the rule is there.
    description: str = Field(default="", max_length=512, pattern=NO_NUL)

    @field_validator("kind")
    @classmethod
    def _kind_is_known(cls, kind: str) -> str:
        error = unknown_kind_error(kind)
        if error is not None:
            raise ValueError(error)
        return kind

    @model_validator(mode="after")
    def _steps_make_sense(self) -> Rule:
        if len(set(self.steps)) != len(self.steps):
            raise ValueError(f"rule for {self.kind!r} repeats a step: {self.steps}")
        if Step.RESTART in self.steps and Step.ROLLBACK in self.steps:
            raise ValueError(
                f"rule for {self.kind!r}: 'restart' and 'rollback' both restart the job; choose one"
            )
        if Step.ALERT in self.steps[1:]:
            raise ValueError(
                f"rule for {self.kind!r}: 'alert' must be the first step (it is recorded at"
                " the first match, before any other step)"
            )
        return self

    @property
    def actions(self) -> list[Step]:
        """The steps that act (all but ``alert``), run once the rule's conditions hold."""
        return [s for s in self.steps if s is not Step.ALERT]


class Guards(BaseModel):
    """Guard rails that hold even when a rule says act."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Circuit breaker: never isolate more than this share of known nodes within the window.
    max_isolated_fraction: float = Field(default=0.25, gt=0.0, le=1.0)
    isolation_window_s: float = Field(default=3600.0, gt=0.0)
    #: Rate limit: at most this many restarts of one job within the window.
    max_restarts_per_job: int = Field(default=3, ge=0, le=INT32_MAX)
    restart_window_s: float = Field(default=3600.0, gt=0.0)
    #: No action on stale evidence: an incident not updated for this long is left alone.
    stale_after_s: float = Field(default=300.0, gt=0.0)
    #: Job incidents opened between the start of a remediation and this long after the job
    #: resumed (ranks stopping, peers timing out, late reports of the old run) are
    #: consequences of the restart, absorbed rather than acted on. Kept short: a new fault
    #: right after a resume is real and must be acted on.
    settle_s: float = Field(default=5.0, ge=0.0)
    #: How long a protective checkpoint may take before the engine goes on without it.
    checkpoint_timeout_s: float = Field(default=60.0, gt=0.0)
    #: A restarted job that has not completed a step this long after its restart is
    #: reported as failed to resume (and its next incident is acted on again).
    resume_timeout_s: float = Field(default=600.0, gt=0.0)
    #: Window in which a node that is the culprit again counts as a repeat offender.
    repeat_window_s: float = Field(default=3600.0, gt=0.0)


class Restarts(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Smallest data-parallel size a shrunk restart may use.
    min_dp: int = Field(default=1, ge=1, le=INT32_MAX)
    #: The global batch (or any number the data-parallel size must divide).
    dp_must_divide: int | None = Field(default=None, ge=1, le=INT32_MAX)
    #: Grow back to the original size when healthy capacity returns: restarts add healthy
    #: spares back, and a job left running below its first size is restarted on its own
    #: (checkpoint, then restart) once enough healthy, non-isolated spares exist.
    grow: bool = False


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    #: Record what would be done (actions with status ``dry_run``) and do nothing.
    dry_run: bool = False
    rules: list[Rule] = Field(default_factory=lambda: list(DEFAULT_RULES), max_length=256)
    guards: Guards = Field(default_factory=Guards)
    restarts: Restarts = Field(default_factory=Restarts)

    @model_validator(mode="after")
    def _windows_fit(self) -> Policy:
        for i, rule in enumerate(self.rules):
            if rule.actions and rule.after_s >= self.guards.stale_after_s:
                raise ValueError(
                    f"rules.{i} ({rule.kind!r}): after_s={rule.after_s:g} must be below "
                    f"guards.stale_after_s={self.guards.stale_after_s:g}, or its incident's "
                    "evidence is stale before the rule may act"
                )
        return self

    def rule_for(self, kind: str, severity: str) -> Rule | None:
        for rule in self.rules:
            if rule.kind not in (kind, "*"):
                continue
            if rule.severity == "critical" and severity != "critical":
                continue
            return rule
        return None


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        kind="gpu_fault", severity="critical", steps=[Step.CHECKPOINT, Step.ISOLATE, Step.RESTART]
    ),
    Rule(kind="node_lost", steps=[Step.ISOLATE, Step.RESTART]),
    Rule(
        kind="hang",
        steps=[Step.CAPTURE_EVIDENCE, Step.ISOLATE, Step.RESTART],
        isolate_when=IsolateWhen.HARDWARE_OR_REPEAT,
    ),
    Rule(
        kind="comm_hang",
        steps=[Step.CAPTURE_EVIDENCE, Step.RESTART],
        description="the path, not a rank, is at fault: restart; the link probe localizes it",
    ),
    Rule(
        kind="rank_crash",
        steps=[Step.ISOLATE, Step.RESTART],
        isolate_when=IsolateWhen.HARDWARE_OR_REPEAT,
    ),
    Rule(kind="comm_failure", steps=[Step.RESTART]),
    Rule(
        kind="straggler",
        steps=[Step.ALERT, Step.CHECKPOINT, Step.ISOLATE, Step.RESTART],
        after_s=30.0,
        min_cost_pct=10.0,
        isolate_when=IsolateWhen.HARDWARE_OR_REPEAT,
    ),
    Rule(
        kind="gpu_degraded",
        steps=[Step.CHECKPOINT],
        description=(
            "correctable ECC errors rising or hardware throttling: the GPU may fail soon, "
            "so save the job's state while it still can"
        ),
    ),
    Rule(
        kind="nonfinite",
        steps=[Step.ALERT, Step.CAPTURE_EVIDENCE, Step.ISOLATE, Step.ROLLBACK],
        min_bad_steps=3,
        isolate_when=IsolateWhen.HARDWARE_OR_REPEAT,
        description=(
            "NaN/Inf entered a collective in 3 steps (1 is an fp16 overflow the loss scaler "
            "skips): every later checkpoint carries it and retention would soon delete the "
            "clean ones, so stop and resume from the newest checkpoint committed before the "
            "first bad step; isolate the origin's node only when it repeats or "
            "has hardware evidence (a bad data shard also has a single origin)"
        ),
    ),
    Rule(kind="*", steps=[Step.ALERT]),
)


class PolicyError(ValueError):
    """A policy file or document that does not validate; the message names the field."""


def first_error(exc: ValidationError, prefix: str = "") -> str:
    """One line naming the first invalid field (``rules.0.steps.0: Input should be …``)."""
    err = exc.errors()[0]
    where = prefix + ".".join(str(p) for p in err["loc"]) or "policy"
    more = f" (and {exc.error_count() - 1} more errors)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def read_document(path: Path, what: str) -> object:
    """A YAML (or JSON) file's content, or a one-line :class:`PolicyError` saying why not."""
    try:
        return load_yaml(read_text(path))
    except Unreadable as exc:
        raise PolicyError(f"cannot read {what} {path}: {exc.reason}") from None
    except Unparsable as exc:
        raise PolicyError(f"{what} {path} is not valid YAML: {exc.reason}") from None


def parse_policy(document: object) -> Policy:
    """Validate a decoded policy; ``None`` (an empty document) is refused, not defaulted:
    the defaults isolate and restart, and a truncated file or an empty mounted ConfigMap
    must not switch that on in silence."""
    if document is None:
        raise PolicyError("the policy is empty")
    try:
        return Policy.model_validate(document)
    except ValidationError as exc:
        raise PolicyError(first_error(exc)) from None


def load_policy(path: Path | None) -> Policy:
    """The policy in ``path`` (YAML or JSON), or the defaults when no file is configured.

    A file that is empty (or holds only comments) is refused: the operator named a file to
    choose the policy, and the built-in defaults (isolate, restart) are not that choice.
    ``{}`` in the file asks for the defaults on purpose.
    """
    if path is None:
        return Policy()
    document = read_document(path, "policy file")
    if document is None:
        raise PolicyError(
            f"policy file {path} is empty: write the policy in it ({{}} for the built-in "
            "defaults), or unset policy_file"
        )
    try:
        return parse_policy(document)
    except PolicyError as exc:
        raise PolicyError(f"policy file {path}: {exc}") from None
