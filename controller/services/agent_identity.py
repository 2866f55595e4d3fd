"""Which node an agent may speak for (issue 14, in the spirit of NodeRestriction).

A shared agent token lets whoever holds it report as *any* node, so one compromised node
could fake a fatal XID on others and have the policy isolate them. Two kinds of credential
bind an agent to one node:

* **per-node tokens** issued and rotated by the controller (``POST
  /api/v1/agent-credentials/{node}``, ``trainguard agent-token issue NODE``): random, shown
  once, kept only as sha256 digests in ``agent_credentials``. Rotation issues a new token and
  gives the node's older ones a grace period, after which they stop working. Issuing is
  audited as an action row (``issue_agent_token``) written in the same transaction as the
  token's row, so a crash can leave neither a token without its record nor a record that
  says ``pending`` for ever. Revocation
  (``DELETE /api/v1/agent-credentials/{node}``, ``trainguard agent-token revoke NODE``) ends
  all of them at once: the node's next report is 401. It is audited as an action row
  (``revoke_agent_tokens``) written in the same transaction;
* **Kubernetes service-account tokens** (a projected token of the agent DaemonSet's pod):
  verified by the API server with a ``TokenReview``; the node is the one the API server bound
  the token to (``user.extra["authentication.kubernetes.io/node-name"]``), never a value the
  agent chooses. Only tokens of the configured service account are agents.

The route then refuses (403) a report whose ``node.name`` is not the credential's node.
Shared agent tokens from the settings work only with ``allow_shared_agent_tokens`` (off by
default).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Connection

from controller.auth import Authenticator, Principal, bearer_credential
from controller.errors import Forbidden, Unauthenticated
from controller.store import Store

#: Prefix of per-node tokens, so a leaked one is recognizable (and secret scanners can match).
TOKEN_PREFIX = "tgn_"
#: Kind of the action row that audits a revocation.
REVOKE_ACTION = "revoke_agent_tokens"
#: Kind of the action row that audits an issue (or rotation).
ISSUE_ACTION = "issue_agent_token"
#: The API server's extra field naming the node a projected service-account token is bound to.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


@dataclass(frozen=True, slots=True)
class NodeCredential:
    node: str
    digest: str
    created_unix_s: float
    expires_unix_s: float | None


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A freshly issued token (shown once), its credential, and until when the node's older
    tokens stay valid (``None``: it had none)."""

    #: Out of ``repr``: an object logged by mistake must not log the token with it.
    token: str = field(repr=False)
    credential: NodeCredential
    previous_valid_until_unix_s: float | None


def _audit_row(
    kind: str, node: str, by: str, now: float, params: dict[str, Any], outcome: str
) -> dict[str, Any]:
    """The ``succeeded`` action row that audits a change to ``node``'s credentials, written
    in the change's own transaction (never the token or its digest)."""
    return {
        "kind": kind,
        "target": f"node:{node}"[:512],
        "trigger": by[:128],
        "params": {"node": node, **params},
        "status": "succeeded",
        "outcome": outcome,
        "created_unix_s": now,
        "finished_unix_s": now,
    }


@dataclass(frozen=True, slots=True)
class ReviewResult:
    """What a TokenReview said: authenticated, as whom, bound to which node."""

    authenticated: bool
    username: str = ""
    node: str | None = None
    error: str = ""


class TokenReviewer(Protocol):
    def review(self, token: str) -> ReviewResult: ...


class KubeTokenReviewer:
    """``TokenReview`` through the official client (``AuthenticationV1Api``); blocking, so
    the resolver calls it in a thread and caches the answer."""

    def __init__(self, api_client: Any, *, audiences: list[str]) -> None:
        from kubernetes import client

        self._client = client
        self._api = client.AuthenticationV1Api(api_client)
        self._audiences = audiences

    def review(self, token: str) -> ReviewResult:
        body = self._client.V1TokenReview(
            spec=self._client.V1TokenReviewSpec(token=token, audiences=self._audiences or None)
        )
        result = self._api.create_token_review(body)
        status = result.status
        if status is None or not status.authenticated:
            return ReviewResult(False, error=(status.error if status else "") or "not valid")
        user = status.user
        extra = (user.extra if user is not None else None) or {}
        nodes = extra.get(NODE_NAME_EXTRA) or []
        return ReviewResult(
            True,
            username=(user.username if user is not None else "") or "",
            node=nodes[0] if len(nodes) == 1 else None,
        )


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class NodeCredentials:
    """Per-node tokens: an in-memory digest map (the hot path) backed by the database.

    Write-then-publish: the map changes only after the database took the new row."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._by_digest: dict[str, NodeCredential] = {}

    async def load(self) -> None:
        from controller.db.repositories.agent_credentials import load_credentials

        rows = await self._store.read(load_credentials)
        self._by_digest = {
            row.digest: NodeCredential(
                row.node_name, row.digest, row.created_unix_s, row.expires_unix_s
            )
            for row in rows
        }

    async def issue(self, node: str, *, by: str, grace_s: float) -> IssuedToken:
        """A new token for ``node``; the node's current tokens stay valid ``grace_s`` more.

        The credential and its ``issue_agent_token`` audit row (``succeeded``) are one
        transaction: before, the row was written ``pending`` first and finished after, so a
        crash (or a database lost) in between left a row saying ``pending`` for ever, beside
        a token that worked."""
        from controller.db.repositories.actions import insert_action
        from controller.db.repositories.agent_credentials import rotate_credential

        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = self._clock()
        digest = digest_of(token)
        previous = self._previous_valid_until(node, now + grace_s)
        action = _audit_row(
            ISSUE_ACTION,
            node,
            by,
            now,
            {"previous_valid_until_unix_s": previous},
            f"agent token issued for node {node!r}"
            + (f"; older ones valid until {previous:.0f}" if previous is not None else ""),
        )

        def write(conn: Connection) -> None:
            rotate_credential(
                conn,
                node=node,
                digest=digest,
                now=now,
                old_expire_unix_s=now + grace_s,
                created_by=by,
            )
            insert_action(conn, action)  # the one write path of ``actions``

        await self._store.write(write)
        for key, old in list(self._by_digest.items()):
            if old.node == node and old.expires_unix_s is None:
                self._by_digest[key] = NodeCredential(
                    old.node, old.digest, old.created_unix_s, now + grace_s
                )
        credential = NodeCredential(node, digest, now, None)
        self._by_digest[digest] = credential
        return IssuedToken(token, credential, previous)

    def _previous_valid_until(self, node: str, grace_end_unix_s: float) -> float | None:
        """The latest end of ``node``'s existing tokens once a new one is issued (the
        unexpiring ones then end at ``grace_end_unix_s``); ``None`` when it has none."""
        ends = [
            grace_end_unix_s if c.expires_unix_s is None else c.expires_unix_s
            for c in self.for_node(node)
        ]
        return max(ends, default=None)

    async def revoke(self, node: str, *, by: str) -> int:
        """End every valid token of ``node`` now; returns how many. Write, then publish: the
        tokens stop working once the revocation and its audit row are stored."""
        from controller.db.repositories.agent_credentials import revoke_credentials

        now = self._clock()
        valid = [
            c for c in self.for_node(node) if c.expires_unix_s is None or c.expires_unix_s > now
        ]
        if not valid:
            return 0
        action = _audit_row(
            REVOKE_ACTION,
            node,
            by,
            now,
            {"credentials": len(valid)},
            f"{len(valid)} agent token(s) of node {node!r} revoked",
        )
        ended = await self._store.write(
            lambda conn: revoke_credentials(conn, node=node, now=now, action=action)
        )
        for key, old in list(self._by_digest.items()):
            if old.node == node and (old.expires_unix_s is None or old.expires_unix_s > now):
                self._by_digest[key] = NodeCredential(old.node, old.digest, old.created_unix_s, now)
        return int(ended)

    def for_node(self, node: str) -> list[NodeCredential]:
        return sorted(
            (c for c in self._by_digest.values() if c.node == node),
            key=lambda c: c.created_unix_s,
        )

    def lookup(self, digest: str) -> Principal | None:
        credential = self._by_digest.get(digest)
        if credential is None:
            return None
        if credential.expires_unix_s is not None and self._clock() >= credential.expires_unix_s:
            return None
        return Principal(name=f"node:{credential.node}", role="agent", node=credential.node)


class IdentityResolver:
    """Resolves a bearer token to a principal: configured tokens, per-node tokens, then (when
    configured) Kubernetes service-account tokens by TokenReview, cached ``cache_ttl_s``."""

    def __init__(
        self,
        auth: Authenticator,
        credentials: NodeCredentials,
        *,
        reviewer: TokenReviewer | None = None,
        agent_usernames: frozenset[str] = frozenset(),
        cache_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._auth = auth
        self._credentials = credentials
        self._reviewer = reviewer
        self._agent_usernames = agent_usernames
        self._cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._reviewed: dict[str, tuple[float, Principal | None]] = {}
        auth.add_lookup(self.lookup)

    @property
    def credentials(self) -> NodeCredentials:
        return self._credentials

    async def revoke(self, node: str, *, by: str) -> int:
        """Revoke ``node``'s per-node tokens and forget its cached TokenReview answers (a
        service-account token is asked about again; see docs/security.md for ending those)."""
        ended = await self._credentials.revoke(node, by=by)
        for key, (_, principal) in list(self._reviewed.items()):
            if principal is not None and principal.node == node:
                del self._reviewed[key]
        return ended

    def lookup(self, digest: bytes) -> Principal | None:
        """Synchronous: per-node tokens and cached TokenReview answers."""
        hexdigest = digest.hex()
        found = self._credentials.lookup(hexdigest)
        if found is not None:
            return found
        cached = self._reviewed.get(hexdigest)
        if cached is not None and self._clock() < cached[0]:
            return cached[1]
        return None

    async def resolve(self, authorization: str) -> Principal:
        try:
            return self._auth.principal(authorization)
        except Unauthenticated:
            if self._reviewer is None:
                raise
            token = bearer_credential(authorization)
            if token.count(".") != 2:  # not a JWT: no point asking the API server
                raise
            principal = await self._review(token)
            if principal is None:
                raise
            return principal

    async def _review(self, token: str) -> Principal | None:
        assert self._reviewer is not None
        hexdigest = digest_of(token)
        cached = self._reviewed.get(hexdigest)
        if cached is not None and self._clock() < cached[0]:
            return cached[1]
        try:
            result = await asyncio.to_thread(self._reviewer.review, token)
        except Exception as exc:  # the API server is down: not this client's fault to cache
            raise Unauthenticated(f"token review failed ({type(exc).__name__}); retry") from exc
        principal: Principal | None = None
        # As bytes: ``compare_digest`` refuses text that is not ASCII (a TypeError, a 500),
        # and the API server's username is whatever the cluster named the account.
        username = result.username.encode()
        if (
            result.authenticated
            and result.node
            and any(hmac.compare_digest(username, u.encode()) for u in self._agent_usernames)
        ):
            principal = Principal(name=f"sa:{result.node}", role="agent", node=result.node)
        if len(self._reviewed) > 10_000:
            self._reviewed.clear()
        self._reviewed[hexdigest] = (self._clock() + self._cache_ttl_s, principal)
        return principal


def check_reporting_node(principal: Principal, node: str, *, allow_shared: bool) -> None:
    """403 unless ``principal`` may speak for ``node``."""
    if principal.node is None:
        if allow_shared:
            return
        raise Forbidden(
            f"token {principal.name!r} is a shared agent token and shared agent tokens are "
            "disabled; issue a per-node token (trainguard agent-token issue NODE)"
        )
    if principal.node != node:
        raise Forbidden(
            f"token {principal.name!r} is bound to node {principal.node!r}; "
            f"it cannot report for node {node!r}"
        )


def kube_reviewer(api_url: str, *, audience: str) -> KubeTokenReviewer:
    """A reviewer on ``api_url`` (tests: the fake API server), else in-cluster credentials,
    else the kubeconfig, as the Kubernetes actuator finds them."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except ConfigException:
            config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return KubeTokenReviewer(client.ApiClient(cfg), audiences=[audience])


def build_identity(auth: Authenticator, store: Store, settings: Any) -> IdentityResolver:
    """The resolver for these settings (``ControllerSettings``)."""
    reviewer: TokenReviewer | None = None
    if settings.kube_token_review:
        reviewer = kube_reviewer(settings.kube_api_url, audience=settings.kube_token_audience)
    return IdentityResolver(
        auth,
        NodeCredentials(store),
        reviewer=reviewer,
        agent_usernames=frozenset(settings.kube_agent_service_accounts),
    )
