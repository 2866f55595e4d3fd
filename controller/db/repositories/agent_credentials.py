"""Per-node agent credentials: the one write path of ``agent_credentials``."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.orm import Session

from controller.db.models import AgentCredential


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
