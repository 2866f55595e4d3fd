"""Per-node agent credentials: an operator issues (and so rotates) or revokes a node's tokens.

The token is in this one reply and nowhere else (the database keeps its sha256); the node's
older tokens stay valid for ``agent_token_grace_s``, long enough to roll the new one out.
Revoking ends all of a node's tokens at once (a node suspected compromised), audited as an
action row. Issuing is audited too (``issue_agent_token``): its row is written
``succeeded`` in the same transaction as the token's own row, so no token ever works
without a record of who issued it, and no record says ``pending`` for a token that exists
(or never will). An issue the database refused leaves a ``failed`` row when the database
takes that one. Neither row holds the token or its digest.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, Field

from controller.api.deps import AUTH_ERRORS, NOT_FOUND, ServicesDep, require_operator
from controller.auth import Principal
from controller.errors import ControllerError, NotFound
from controller.services.agent_identity import ISSUE_ACTION, IdentityResolver
from controller.services.container import Services
from trainguard.wire import NAME_PATTERN

log = logging.getLogger(__name__)
router = APIRouter(tags=["agent-credentials"])

NodeName = Path(description="Node name", pattern=NAME_PATTERN, max_length=253)


class AgentCredentialPublic(BaseModel):
    node: str
    created_unix_s: float
    expires_unix_s: float | None


class AgentTokenIssued(AgentCredentialPublic):
    token: str = Field(repr=False)  # in the answer's body, never in a logged repr
    previous_valid_until_unix_s: float | None


class AgentTokensRevoked(BaseModel):
    node: str
    #: Tokens that were valid and are not any more.
    revoked: int


class AgentCredentialsPublic(BaseModel):
    data: list[AgentCredentialPublic]
    count: int


def _resolver(request: Request) -> IdentityResolver:
    resolver: IdentityResolver = request.app.state.identity
    return resolver


@router.post(
    "/agent-credentials/{node}",
    operation_id="issue_agent_token",
    status_code=201,
    response_model=AgentTokenIssued,
    responses=AUTH_ERRORS,
)
async def issue_agent_token(
    request: Request,
    node: str = NodeName,
    principal: Principal = Depends(require_operator),
    services: Services = ServicesDep,
) -> AgentTokenIssued:
    """A new agent token bound to ``node`` (the node's previous ones expire after the grace).

    Audited as an ``issue_agent_token`` action row (target ``node:NODE``, trigger
    ``operator:NAME``), written in the token's own transaction."""
    grace_s: float = services.settings.agent_token_grace_s
    by = f"operator:{principal.name}"
    try:
        issued = await _resolver(request).credentials.issue(node, by=by, grace_s=grace_s)
    except ControllerError as exc:
        await _record_refusal(services, node, by, exc.message)
        raise
    return AgentTokenIssued(
        node=node,
        token=issued.token,
        created_unix_s=issued.credential.created_unix_s,
        expires_unix_s=None,
        previous_valid_until_unix_s=issued.previous_valid_until_unix_s,
    )


async def _record_refusal(services: Services, node: str, by: str, message: str) -> None:
    """A ``failed`` row for an issue the database refused (no token exists). Best effort: a
    database still down loses only this row, and the operator has the 503 in hand."""
    try:
        await services.actions.create(
            kind=ISSUE_ACTION,
            target=f"node:{node}",
            trigger=by,
            params={"node": node},
            status="failed",
            outcome=f"not issued: {message}",
        )
    except ControllerError as exc:
        log.warning(
            "refused agent token issue not audited",
            extra={"fields": {"node": node, "error": exc.message}},
        )


@router.get(
    "/agent-credentials/{node}",
    operation_id="list_agent_credentials",
    response_model=AgentCredentialsPublic,
    responses=AUTH_ERRORS,
)
async def list_agent_credentials(
    request: Request,
    node: str = NodeName,
    _principal: Principal = Depends(require_operator),
) -> AgentCredentialsPublic:
    """The node's credentials (never the tokens): when each was issued and when it ends."""
    data = [
        AgentCredentialPublic(
            node=c.node, created_unix_s=c.created_unix_s, expires_unix_s=c.expires_unix_s
        )
        for c in _resolver(request).credentials.for_node(node)
    ]
    return AgentCredentialsPublic(data=data, count=len(data))


@router.delete(
    "/agent-credentials/{node}",
    operation_id="revoke_agent_tokens",
    response_model=AgentTokensRevoked,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def revoke_agent_tokens(
    request: Request,
    node: str = NodeName,
    principal: Principal = Depends(require_operator),
) -> AgentTokensRevoked:
    """End every valid agent token of ``node`` now: its next report is 401 (no grace)."""
    revoked = await _resolver(request).revoke(node, by=f"operator:{principal.name}")
    if not revoked:
        raise NotFound(f"node {node!r} has no valid agent token to revoke")
    return AgentTokensRevoked(node=node, revoked=revoked)
