"""Actions: what the control loops did to the cluster, for operators to audit.

An action is written when it starts (``pending``) and updated when it ends, each in its own
transaction off the group-commit queue: actions are rare (one per GPU per level change) and
an operator asking "what did the policy do?" must see the row before the command lands.
A change that must never exist without its audit row (an isolation) puts the row's write
(:meth:`ActionService.inserting`, :meth:`ActionService.updating`) in its own transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from controller.db.repositories import actions as repo
from controller.store import Store

#: Statuses an action ends in (``ActionPublic.status``).
FINAL_STATUSES = frozenset({"succeeded", "failed", "dry_run", "skipped"})


class ActionService:
    def __init__(self, store: Store) -> None:
        self._store = store

    @staticmethod
    def inserting(
        *,
        kind: str,
        target: str,
        trigger: str,
        params: dict[str, Any],
        status: str = "pending",
        outcome: str = "",
        created_unix_s: float | None = None,
    ) -> Callable[[Connection], int]:
        """The insert of one action row as a step of a caller's transaction (returns the
        row's id): a change and its audit row committed together, never one alone."""
        row = {
            "kind": kind[:64],
            "target": target[:512],
            "trigger": trigger[:128],
            "params": params,
            "status": status,
            "outcome": outcome,
            "created_unix_s": time.time() if created_unix_s is None else created_unix_s,
            "finished_unix_s": None if status not in FINAL_STATUSES else time.time(),
        }
        return lambda conn: repo.insert_action(conn, row)

    async def create(
        self,
        *,
        kind: str,
        target: str,
        trigger: str,
        params: dict[str, Any],
        status: str = "pending",
        outcome: str = "",
        created_unix_s: float | None = None,
    ) -> int:
        """Insert one action row and return its durable id."""
        insert = self.inserting(
            kind=kind,
            target=target,
            trigger=trigger,
            params=params,
            status=status,
            outcome=outcome,
            created_unix_s=created_unix_s,
        )
        return await self._store.write(insert)

    @staticmethod
    def updating(
        action_id: int,
        *,
        params: dict[str, Any] | None = None,
        status: str | None = None,
        outcome: str | None = None,
        finished_unix_s: float | None = None,
    ) -> Callable[[Connection], None]:
        """The update of an action's given fields as a step of a caller's transaction."""
        values: dict[str, Any] = {}
        if params is not None:
            values["params"] = params
        if status is not None:
            values["status"] = status
        if outcome is not None:
            values["outcome"] = outcome
        if finished_unix_s is not None:
            values["finished_unix_s"] = finished_unix_s
        return lambda conn: repo.update_action(conn, action_id, values) if values else None

    async def update(
        self,
        action_id: int,
        *,
        params: dict[str, Any] | None = None,
        status: str | None = None,
        outcome: str | None = None,
        finished_unix_s: float | None = None,
    ) -> None:
        """Change the given fields of an action (``params`` replaces the whole dict)."""
        if params is None and status is None and outcome is None and finished_unix_s is None:
            return
        await self._store.write(
            self.updating(
                action_id,
                params=params,
                status=status,
                outcome=outcome,
                finished_unix_s=finished_unix_s,
            )
        )


__all__ = ["FINAL_STATUSES", "ActionService"]
