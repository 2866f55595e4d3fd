"""Remediation: the policy, what it did, node isolation by hand, and goodput per job."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, Field, ValidationError

from controller.api.deps import (
    AUTH_ERRORS,
    NOT_FOUND,
    ServicesDep,
    job_ended,
    require_operator,
    require_viewer,
)
from controller.auth import Principal
from controller.errors import Conflict, InvalidInput, NotFound
from controller.logic.remediation.rules import Policy, first_error
from controller.services import queries
from controller.services.container import Services
from controller.services.operator_actions import isolation_audit
from trainguard.limits import NO_NUL

router = APIRouter(tags=["remediation"])


@router.get("/remediation", operation_id="get_remediation", responses=AUTH_ERRORS)
async def get_remediation(
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """The policy in force, the remediations it ran (newest first) and isolated nodes."""
    engine = services.remediation
    return {**engine.snapshot(), "policy": engine.policy.model_dump(mode="json")}


@router.put("/remediation/policy", operation_id="put_remediation_policy", responses=AUTH_ERRORS)
async def put_policy(
    policy: Policy = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Replace the whole policy (validated strictly; 422 names the field): a field left out
    takes its built-in default, rules included. To change some fields and keep the rest,
    use PATCH. It lasts until the controller restarts, which reads ``policy_file`` again:
    keep the file the source of truth."""
    return await _set_policy(services, principal, policy, "policy replaced")


@router.patch("/remediation/policy", operation_id="patch_remediation_policy", responses=AUTH_ERRORS)
async def patch_policy(
    changes: dict[str, Any] = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Change the top-level fields given (``{"dry_run": true}``) and keep the others as
    they are in force: a field given replaces that field whole (``guards`` given is the
    whole ``guards``). The result is validated like a PUT (422 names the field)."""
    current = services.remediation.policy.model_dump(mode="json")
    try:
        policy = Policy.model_validate(current | changes)
    except ValidationError as exc:
        raise InvalidInput(first_error(exc)) from None
    changed = ", ".join(sorted(changes)) or "nothing"
    return await _set_policy(services, principal, policy, f"policy changed: {changed}")


async def _set_policy(
    services: Services, principal: Principal, policy: Policy, outcome: str
) -> dict[str, Any]:
    """Write, then publish: the audit row first, so a database that fails (503) leaves the
    old policy in force and no change goes unrecorded. Remediations already running see the
    new ``dry_run`` / ``enabled`` before their next step."""
    await services.actions.create(
        kind="set_policy",
        target="remediation",
        trigger=f"operator:{principal.name}",
        params={"rules": len(policy.rules), "dry_run": policy.dry_run, "enabled": policy.enabled},
        status="succeeded",
        outcome=outcome[:2000],
    )
    services.remediation.policy = policy
    return policy.model_dump(mode="json")


class IsolationRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=500, pattern=NO_NUL)


async def _node_action(
    services: Services, name: str, principal: Principal, *, isolate: bool, reason: str
) -> dict[str, Any]:
    node = services.state.nodes.get(name)
    if node is None:
        raise NotFound(f"node {name!r} not found; it appears after its first report")
    if isolate == (node.isolated_reason is not None):
        state = "isolated" if isolate else "not isolated"
        raise Conflict(f"node {name!r} is already {state}")
    engine = services.remediation
    audit = isolation_audit(services.actions, engine, name, principal.name, reason, isolate=isolate)
    ok, outcome, action = await engine.apply_isolation(
        name, isolate=isolate, reason=reason, audit=audit
    )
    if not ok:
        kind = "isolate_node" if isolate else "release_node"
        raise Conflict(f"{kind} {name}: {outcome} (action {action})")
    # Isolation keeps new work off (cordon + taint); what already runs there goes on until
    # it is restarted. The operator who isolated by hand is told which jobs those are.
    running = sorted(
        job.name
        for job in services.state.jobs.values()
        if any(r.node == name and r.state == "running" for r in job.ranks.values())
    )
    return {
        "node": name,
        "isolated": isolate,
        "action": action,
        "outcome": outcome,
        "running_jobs": running,
    }


@router.post(
    "/nodes/{name}/isolate",
    operation_id="isolate_node",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def isolate_node(
    name: str = Path(max_length=253),
    body: IsolationRequest = Body(),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Keep work off a node (cordon + taint on Kubernetes) until it is released.
    ``running_jobs``: the jobs with a rank running there, which isolation does not move
    (``POST /jobs/{name}/restart`` does)."""
    return await _node_action(services, name, principal, isolate=True, reason=body.reason)


@router.post(
    "/nodes/{name}/release",
    operation_id="release_node",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def release_node(
    name: str = Path(max_length=253),
    body: IsolationRequest | None = Body(default=None),
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Put an isolated node back into service (after repair, or a false alarm)."""
    reason = body.reason if body else f"released by {principal.name}"
    return await _node_action(services, name, principal, isolate=False, reason=reason)


@router.get(
    "/jobs/{name}/goodput",
    operation_id="get_job_goodput",
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def job_goodput(
    name: str = Path(max_length=253),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> dict[str, Any]:
    """Productive vs. lost time of a job, and what each incident cost it."""
    book = services.remediation.jobs.get(name)
    if book is None:
        if await job_ended(services, name):  # its goodput record left memory with it
            raise NotFound(queries.ENDED.format(name=name) + "; its goodput record went with it")
        raise NotFound(f"job {name!r} has no goodput record; it starts with the job's first step")
    return book.ledger.snapshot()
