"""``capture_evidence``: keep what the job's ranks and in-flight collectives looked like."""

from __future__ import annotations

from controller.logic.remediation.params import CapturedCall, CapturedRank, CaptureParams
from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState


class CaptureEvidence:
    step = Step.CAPTURE_EVIDENCE
    action_kind = "capture_evidence"

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        job = ctx.state.jobs.get(rem.job or "")
        ranks = (
            [
                CapturedRank(
                    rank=r.rank,
                    node=r.node,
                    state=r.state,
                    last_step=r.last_step,
                    inflight=[
                        CapturedCall(op=c.op, seq=c.seq, group=c.group) for c in r.inflight[:4]
                    ],
                )
                for r in sorted(job.ranks.values(), key=lambda r: r.rank)
            ]
            if job is not None
            else []
        )
        status = "dry_run" if rem.dry_run else "succeeded"
        outcome = f"captured the state of {len(ranks)} ranks"
        await ctx.recorder.record(
            incident,
            rem,
            self.action_kind,
            rem.job or "",
            CaptureParams(ranks=ranks).to_params(),
            status,
            outcome,
        )
        return True, outcome
