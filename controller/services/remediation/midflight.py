"""A policy change reaches the remediations already running, before each of their steps.

The engine reads ``enabled`` and ``dry_run`` when it decides, but a remediation can run
for minutes (a checkpoint it waits for, a restart): an operator who turns on dry run, or
turns the engine off, means it as a stop switch for those too. So every step first
re-reads the policy in force (:func:`go_on`):

* ``dry_run`` now: the remediation becomes a dry run; its remaining steps are recorded
  as ``dry_run`` rows (what they would have done) and do nothing. Turning dry run off
  again does not make a dry run act: that takes a new decision.
* ``enabled: false`` now: the remediation stops; each remaining step gets a ``skipped``
  row saying "remediation disabled by policy change at <time>" (the time the step saw it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from controller.logic.remediation.rules import Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps import STEP_ACTION_KIND, StepContext
from controller.state import IncidentState

log = logging.getLogger(__name__)


def disabled_note(at_unix_s: float) -> str:
    at = datetime.fromtimestamp(at_unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"remediation disabled by policy change at {at}"


async def go_on(
    ctx: StepContext, rem: Remediation, incident: IncidentState | None, left: Sequence[Step]
) -> bool:
    """Whether ``rem`` runs ``left[0]`` under the policy in force now (``left``: the steps
    not run yet). ``False``: disabled meanwhile, and ``left`` is recorded skipped."""
    policy = ctx.policy
    if policy.enabled:
        if policy.dry_run and not rem.dry_run:
            rem.dry_run = True
            log.warning("remediation turned dry run", extra={"fields": {"rem": rem.id}})
        return True
    note = disabled_note(time.time())
    log.warning("remediation stopped: disabled", extra={"fields": {"rem": rem.id}})
    for step in left:
        kind = STEP_ACTION_KIND.get(step)
        if kind is None or step == Step.ALERT:
            continue
        target = (rem.node if step == Step.ISOLATE else rem.job) or rem.job or rem.node or ""
        await ctx.recorder.record(incident, rem, kind, target, {}, "skipped", note)
    rem.outcome = note
    return False


__all__ = ["disabled_note", "go_on"]
