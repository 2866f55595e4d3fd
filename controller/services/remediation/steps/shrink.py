"""Where a restarted job runs next: the same size on spares, *shrunk* to a smaller
data-parallel size when healthy nodes are short, or grown back to its first size.

Not a step of its own in the policy language: ``restart``, ``rollback`` and the grow-back
all place the job through :func:`plan_placement`, which feeds the pure planner
(:func:`~controller.logic.remediation.planner.plan_restart`) what the cluster looks like.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from controller.logic.remediation.placement import Placement
from controller.logic.remediation.planner import RestartPlan, plan_restart
from controller.logic.remediation.preflight import describe_exclusions, failed_nodes
from controller.services.remediation.steps.base import StepContext


def limits(ctx: StepContext, job: str) -> tuple[int, int | None]:
    """(min_dp, dp_must_divide) for a job: the policy's, tightened by what the job declares
    to its actuator."""
    restarts = ctx.policy.restarts
    min_dp, divide = restarts.min_dp, restarts.dp_must_divide
    own = ctx.actuator.limits(job) if ctx.actuator is not None else None
    if own is not None:
        min_dp = max(min_dp, own.min_dp)
        divide = own.dp_must_divide or divide
    return min_dp, divide


def excluded(
    ctx: StepContext, candidates: list[str], current: Placement, *, grow_back: bool
) -> set[str]:
    """Nodes a restart must not use: isolated, unhealthy and lost ones, and those whose
    last preflight failed. A grow-back is stricter: a spare it adds must be known healthy
    (its agent reports it so)."""
    out = {
        n.name
        for n in ctx.state.nodes.values()
        if n.isolated_reason is not None or n.health in ("unhealthy", "lost")
    }
    out |= set(failed_nodes(ctx.commands.preflight_verdicts()))
    if grow_back:
        for name in candidates:
            node = ctx.state.nodes.get(name)
            if name not in current.nodes and (node is None or node.health != "healthy"):
                out.add(name)
    return out


async def plan_placement(
    ctx: StepContext,
    job: str,
    current: Placement,
    *,
    grow_back: bool,
    resume_step: int | None = None,
    also_excluded: Collection[str] = (),
) -> RestartPlan:
    """The next placement of ``job``; ``grow_back``: only healthy spares are added.
    ``resume_step``: a rollback's bound, the newest checkpoint the ranks may resume from
    (``None``: the newest committed one, whichever it is when they start).
    ``also_excluded``: nodes a dry run would have isolated (they are not isolated)."""
    assert ctx.actuator is not None
    candidates = await ctx.actuator.candidate_nodes(job)
    min_dp, divide = limits(ctx, job)
    ctx.original_nodes.setdefault(job, len(current.nodes))
    plan = plan_restart(
        current,
        candidates,
        excluded(ctx, candidates, current, grow_back=grow_back) | set(also_excluded),
        min_dp=min_dp,
        dp_must_divide=divide,
        original_nodes=ctx.original_nodes[job],
        grow=ctx.policy.restarts.grow or grow_back,
        resume_step=resume_step,
    )
    # Say why a node the job could have used was passed over for a failed preflight.
    failed = failed_nodes(ctx.commands.preflight_verdicts())
    clause = describe_exclusions(failed, [*current.nodes, *candidates])
    if not clause:
        return plan
    return dataclasses.replace(plan, reason=f"{plan.reason}; {clause}")
