"""Node changes that do not come from a report: isolation, set by policy or by an operator.

Node rows have one write path, :mod:`controller.db.repositories.nodes`; isolation is
written there first (on the writer's thread, ordered with the group commits) and shown in
:class:`~controller.state.ClusterState` only once it is durable. Remediation steps and the
API ask this service instead of writing ``nodes`` themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection

from controller.db.repositories import nodes as repo_nodes
from controller.errors import StoreUnavailable
from controller.state import ClusterState
from controller.writer import GroupCommitWriter

T = TypeVar("T")


class NodeRecords:
    def __init__(self, state: ClusterState, writer: GroupCommitWriter) -> None:
        self._state = state
        self._writer = writer

    async def set_isolation(
        self,
        node: str,
        reason: str | None,
        *,
        audit: Callable[[Connection], T] | None = None,
    ) -> T | None:
        """Record (or clear, with ``None``) a node's isolation; returns once it is durable.

        ``audit`` (the isolation's action row) is written in the same transaction, so an
        isolation never exists without its record nor a record without its isolation;
        returns what ``audit`` returned. A node that has not reported yet has no row: only
        ``audit`` is written."""
        state = self._state.nodes.get(node)
        at = time.time() if reason is not None else None

        def write(conn: Connection) -> T | None:
            if state is not None and not repo_nodes.set_isolation(conn, node, reason, at):
                # Raised inside the transaction, so ``audit`` is rolled back with it.
                raise StoreUnavailable(
                    f"node {node!r} is not stored yet (its first report is being committed); "
                    "retry in a moment"
                )
            return audit(conn) if audit is not None else None

        if state is None and audit is None:
            return None  # no row: the node has not reported yet
        # Write, then publish: a reason the database refuses (a NUL byte on PostgreSQL)
        # raises here and leaves the node as the API showed it, so memory and the database
        # never disagree and the node's next reports still store (issue 14).
        written = await self._writer.run(write)
        if state is not None:
            state.isolated_reason, state.isolated_unix_s = reason, at
        return written

    def isolated(self) -> list[str]:
        return sorted(n.name for n in self._state.nodes.values() if n.isolated_reason is not None)


__all__ = ["NodeRecords"]
