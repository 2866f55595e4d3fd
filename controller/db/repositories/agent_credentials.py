"""Per-node agent credentials: the one write path of ``agent_credentials``."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.orm import Session

from controller.db.models import AgentCredential
from controller.db.repositories.actions import insert_action


def load_credentials(session: Session) -> Sequence[AgentCredential]:
    return session.execute(select(AgentCredential)).scalars().all()


def rotate_credential(
    conn: Connection,
    *,
    node: str,
    digest: str,
    now: float,
    old_expire_unix_s: float,
    created_by: str,
) -> None:
    """Add ``digest`` for ``node`` and let the node's unexpiring credentials end at
    ``old_expire_unix_s`` (one transaction: a node is never left without a valid token)."""
    conn.execute(
        update(AgentCredential)
        .where(AgentCredential.node_name == node, AgentCredential.expires_unix_s.is_(None))
        .values(expires_unix_s=old_expire_unix_s)
    )
    conn.execute(
        insert(AgentCredential).values(
            digest=digest,
            node_name=node,
            created_unix_s=now,
            expires_unix_s=None,
            created_by=created_by,
        )
    )


def revoke_credentials(
    conn: Connection, *, node: str, now: float, action: dict[str, object]
) -> int:
    """End every still-valid credential of ``node`` at ``now`` and record ``action`` (the
    audit row) in the same transaction: a revocation is never without its record. Returns
    how many credentials were ended. The rows are kept, so the history stays readable."""
    ended = conn.execute(
        update(AgentCredential)
        .where(
            AgentCredential.node_name == node,
            (AgentCredential.expires_unix_s.is_(None)) | (AgentCredential.expires_unix_s > now),
        )
        .values(expires_unix_s=now)
    ).rowcount
    if ended:
        insert_action(conn, dict(action))  # the one write path of ``actions``
    return int(ended or 0)
