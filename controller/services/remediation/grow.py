"""Growing jobs back: restart a job left below its first size once healthy spares return.

With ``restarts.grow`` on, the engine's tick looks every ``check_interval_s`` (the
``remediation_grow_check_interval_s`` setting, ``GROW_CHECK_INTERVAL_S`` by default; each
look asks the actuator where the job runs). A grow-back is a remediation of its own (trigger
``grow:<job>``): a protective checkpoint, then a restart on the larger placement. A refused
(or dry-run) grow-back is recorded once per placement.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping

from controller.actuators.base import ActuatorError
from controller.logic.remediation.planner import RestartPlan
from controller.logic.remediation.rules import Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps import StepContext
from controller.services.remediation.steps.restart import ACTION_KIND
from controller.services.remediation.steps.shrink import plan_placement

log = logging.getLogger(__name__)

#: How often the leader looks for jobs to grow back (by default).
GROW_CHECK_INTERVAL_S = 5.0
#: The steps of a grow-back remediation.
GROW_STEPS = [Step.CHECKPOINT, Step.RESTART]

#: Starts a remediation's steps in the background (the engine's ``_start_steps``).
Launch = Callable[[Remediation, list[Step]], None]


class GrowBack:
    def __init__(
        self, ctx: StepContext, launch: Launch, *, check_interval_s: float = GROW_CHECK_INTERVAL_S
    ) -> None:
        if check_interval_s <= 0:
            raise ValueError(f"check_interval_s must be positive, got {check_interval_s}")
        self._ctx = ctx
        self._launch = launch
        self.check_interval_s = check_interval_s
        self.checked_unix_s = 0.0
        #: Job -> the grow-back placement last recorded as refused or dry run (recorded once).
        self._noted: dict[str, str] = {}

    def forget(self, job: str) -> None:
        """A job dropped from memory (``job_retention``): no grow-back of it is noted."""
        self._noted.pop(job, None)

    def due(self, now: float) -> bool:
        return self._ctx.policy.restarts.grow and (
            now - self.checked_unix_s >= self.check_interval_s
        )

    async def check(self, now: float, decided: Mapping[int, str]) -> None:
        """Restart jobs running below their first size once healthy spares are back."""
        self.checked_unix_s = now
        if self._ctx.actuator is None:
            return
        for job, original in sorted(self._ctx.original_nodes.items()):
            try:
                await self._consider(job, original, now, decided)
            except ActuatorError as exc:
                log.warning(
                    "grow-back check failed", extra={"fields": {"job": job, "error": str(exc)}}
                )

    async def _consider(
        self, job: str, original: int, now: float, decided: Mapping[int, str]
    ) -> None:
        ctx = self._ctx
        assert ctx.actuator is not None
        book = ctx.book(job)
        if book.running is not None or book.awaiting_resume is not None:
            return  # an action in flight: grow once it is over
        if any(i.job == job and i.id not in decided for i in ctx.state.incidents.values()):
            return  # an incident of the job waits for a decision: it comes first
        since = book.last_remediation_unix_s
        if since is not None and now < (book.resumed_unix_s or since) + ctx.policy.guards.settle_s:
            return
        current = await ctx.actuator.current_placement(job)
        if current is None or len(current.nodes) >= original:
            self._noted.pop(job, None)
            return
        plan = await plan_placement(ctx, job, current, grow_back=True)
        if plan.placement is None or plan.kind != "grow" or plan.replaced or plan.dropped:
            self._noted.pop(job, None)
            return  # not enough healthy spares (yet) for a larger data-parallel size
        refused = ctx.restarts.refuse(job, now, ctx.policy.guards)
        if refused is None and not ctx.policy.dry_run:
            self._noted.pop(job, None)
            self._grow(job, now, plan)
            return
        key = ",".join(plan.placement.nodes)
        if self._noted.get(job) == key:
            return  # already recorded: one row per refused (or dry-run) grow-back
        self._noted[job] = key
        if refused is None:
            self._grow(job, now, plan)  # dry run: its steps record what they would do
            return
        rem = remediation(ctx, job, now)
        params = {"plan": plan.kind, "reason": plan.reason, "from_nodes": list(current.nodes)}
        await ctx.recorder.record(None, rem, ACTION_KIND, job, params, "skipped", refused)

    def _grow(self, job: str, now: float, plan: RestartPlan) -> None:
        """Checkpoint, then restart on the larger placement (planned again at the restart)."""
        rem = remediation(self._ctx, job, now)
        rem.outcome = plan.reason
        log.info("growing a job back", extra={"fields": {"job": job, "plan": plan.reason}})
        book = self._ctx.book(job)
        book.ledger.fault(now, rem.ledger_id, "grow")
        book.ledger.detected(now, rem.ledger_id)
        self._launch(rem, GROW_STEPS)


def remediation(ctx: StepContext, job: str, now: float) -> Remediation:
    return Remediation(
        id=uuid.uuid4().hex[:12],
        incident_id=None,
        incident_kind="capacity_returned",
        job=job,
        node=None,
        steps=[str(s) for s in GROW_STEPS],
        started_unix_s=now,
        dry_run=ctx.policy.dry_run,
        trigger=f"grow:{job}",
        grow=True,
    )
