"""``checkpoint``: the protective checkpoint before anything is stopped.

Every node running the job is asked (a ``JobCheckpoint`` command, the same request number
on each, so the ranks take one checkpoint for it) and the step waits,
bounded by ``guards.checkpoint_timeout_s``, until the agents report a newer committed
checkpoint; without one the remediation goes on from the newest complete checkpoint.
"""

from __future__ import annotations

import asyncio
import time

from controller.logic.remediation.params import CheckpointParams
from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState
from trainguard import wire

#: How often the wait looks at the job's newest committed checkpoint.
POLL_S = 0.2


class ProtectiveCheckpoint:
    step = Step.CHECKPOINT
    action_kind = "checkpoint"

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        job_name = rem.job
        job = ctx.state.jobs.get(job_name or "")
        nodes = sorted({r.node for r in job.ranks.values() if r.state == "running"}) if job else []
        record = ctx.recorder.record
        if job_name is None or not nodes:
            await record(
                incident, rem, self.action_kind, job_name or "", {}, "skipped", "no running ranks"
            )
            return True, "no running ranks to checkpoint"
        book = ctx.book(job_name)
        waiting = book.awaiting_resume
        if waiting is not None and waiting is not rem:
            # A hardware fault on a node the restart in flight placed the job on (the only
            # way a step runs while a restart awaits resume): the old generation is stopped
            # and the new one has not stepped, so no rank can checkpoint. Asking the old
            # ranks' nodes would only wait out the timeout.
            outcome = (
                f"job {job_name} is restarting (generation {waiting.generation} has not "
                "stepped yet): nothing to checkpoint"
            )
            await record(incident, rem, self.action_kind, job_name, {}, "skipped", outcome)
            return True, outcome
        before = book.checkpoint
        params = CheckpointParams(
            nodes=list(nodes), before_step=before[0] if before else None
        ).to_params()
        if rem.dry_run:
            await record(
                incident, rem, self.action_kind, job_name, params, "dry_run",
                f"would ask {len(nodes)} nodes for a checkpoint of job {job_name}",
            )  # fmt: skip
            return True, "dry run"
        action = await record(incident, rem, self.action_kind, job_name, params, "pending", "")
        asked = time.time()
        for node in nodes:
            # One request number for every node's copy: the ranks agree on it and take one
            # checkpoint, not one per node as the copies arrive steps apart.
            request = wire.JobCheckpoint(
                id="assigned-by-server", job=job_name, reason=rem.id, request=action
            )
            await ctx.commands.create(node, request, by="remediation")
        timeout_s = ctx.policy.guards.checkpoint_timeout_s
        deadline = asked + timeout_s
        while time.time() < deadline:
            latest = book.checkpoint
            if latest is not None and latest[1] >= asked and latest != before:
                took = latest[1] - asked
                outcome = f"checkpoint of step {latest[0]} durable after {took:.1f} s"
                await ctx.recorder.finish(action, "succeeded", outcome)
                return True, outcome
            await asyncio.sleep(POLL_S)
        fallback = f"step {before[0]}" if before else "no checkpoint"
        outcome = (
            f"no durable checkpoint within {timeout_s:.0f} s; "
            f"going on from the newest complete one ({fallback})"
        )
        await ctx.recorder.finish(action, "failed", outcome)
        return False, outcome
