"""Per-node agent credentials: an operator issues (and so rotates) or revokes a node's tokens.

The token is in this one reply and nowhere else (the database keeps its sha256); the node's
older tokens stay valid for ``agent_token_grace_s``, long enough to roll the new one out.
Revoking ends all of a node's tokens at once (a node suspected compromised), audited as an
action row.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel

from controller.api.deps import AUTH_ERRORS, NOT_FOUND, require_operator
from controller.auth import Principal
from controller.errors import NotFound
from controller.services.agent_identity import IdentityResolver
from trainguard.wire import NAME_PATTERN

router = APIRouter(tags=["agent-credentials"])

NodeName = Path(description="Node name", pattern=NAME_PATTERN, max_length=253)


class AgentCredentialPublic(BaseModel):
    node: str
    created_unix_s: float
    expires_unix_s: float | None


class AgentTokenIssued(AgentCredentialPublic):
    token: str
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
) -> AgentTokenIssued:
    """A new agent token bound to ``node`` (the node's previous ones expire after the grace)."""
    grace_s: float = request.app.state.controller.settings.agent_token_grace_s
    credentials = _resolver(request).credentials
    token, credential = await credentials.issue(
        node, by=f"operator:{principal.name}", grace_s=grace_s
    )
    older = [c.expires_unix_s for c in credentials.for_node(node) if c.digest != credential.digest]
    return AgentTokenIssued(
        node=node,
        token=token,
        created_unix_s=credential.created_unix_s,
        expires_unix_s=None,
        previous_valid_until_unix_s=max((e for e in older if e is not None), default=None),
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
