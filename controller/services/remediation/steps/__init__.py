"""Remediation steps, one module each, and the registry the engine runs them from.

To add a step (a webhook that pages someone, say): add its name to
:class:`~controller.logic.remediation.rules.Step`, copy :mod:`.capture` (the smallest step)
to a new module, make its ``run`` act only through ``ctx`` (``ctx.actuator``,
``ctx.recorder``, ``ctx.nodes``) and add an instance to :data:`STEPS` below.
"""

from __future__ import annotations

from controller.logic.remediation.rules import Step
from controller.services.remediation.steps.base import (
    ActionRecorder,
    RemediationStep,
    StepContext,
    StepResult,
)
from controller.services.remediation.steps.capture import CaptureEvidence
from controller.services.remediation.steps.checkpoint import ProtectiveCheckpoint
from controller.services.remediation.steps.isolate import Isolate
from controller.services.remediation.steps.restart import Restart
from controller.services.remediation.steps.rollback import Rollback
from controller.services.remediation.steps.webhook import WebhookStep

#: The step that carries out each ``Step`` of a rule (``alert`` is the engine's own: it is
#: recorded when a rule first matches, not run as part of a remediation).
STEPS: dict[Step, RemediationStep] = {
    s.step: s
    for s in (
        CaptureEvidence(),
        ProtectiveCheckpoint(),
        Isolate(),
        Restart(),
        Rollback(),
        WebhookStep(),
    )
}
#: The action kind each step records, to find where an interrupted remediation stopped.
STEP_ACTION_KIND: dict[Step, str] = {step: s.action_kind for step, s in STEPS.items()}

__all__ = [
    "STEPS",
    "STEP_ACTION_KIND",
    "ActionRecorder",
    "RemediationStep",
    "StepContext",
    "StepResult",
]
