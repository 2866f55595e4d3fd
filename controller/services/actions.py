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
from typing import Any, Required, TypedDict, Unpack

from sqlalchemy import Connection

from controller.db.repositories import actions as repo
from controller.store import Store

#: Statuses an action ends in (``ActionPublic.status``).
FINAL_STATUSES = frozenset({"succeeded", "failed", "dry_run", "skipped"})


class ActionRow(TypedDict, total=False):
    """A new action row's fields, as :meth:`ActionService.create` takes them."""

    kind: Required[str]
    target: Required[str]
    trigger: Required[str]
    params: Required[dict[str, Any]]
    status: str  # "pending" unless given
    outcome: str
    created_unix_s: float | None  # now unless given


class ActionChange(TypedDict, total=False):
    """The fields :meth:`ActionService.update` changes (``None``: left as it is;
    ``params`` replaces the whole dict)."""

    params: dict[str, Any] | None
    status: str | None
    outcome: str | None
    finished_unix_s: float | None


class ActionService:
    def __init__(self, store: Store) -> None:
        self._store = store

    @staticmethod
    def inserting(**row: Unpack[ActionRow]) -> Callable[[Connection], int]:
        """The insert of one action row as a step of a caller's transaction (returns the
        row's id): a change and its audit row committed together, never one alone."""
        status = row.get("status", "pending")
        created = row.get("created_unix_s")
        values = {
            "kind": row["kind"][:64],
            "target": row["target"][:512],
            "trigger": row["trigger"][:128],
            "params": row["params"],
            "status": status,
            "outcome": row.get("outcome", ""),
            "created_unix_s": time.time() if created is None else created,
            "finished_unix_s": None if status not in FINAL_STATUSES else time.time(),
        }
        return lambda conn: repo.insert_action(conn, values)

    async def create(self, **row: Unpack[ActionRow]) -> int:
        """Insert one action row and return its durable id."""
        return await self._store.write(self.inserting(**row))

    @staticmethod
    def _changing(action_id: int, change: ActionChange) -> Callable[[Connection], None] | None:
        """The update of the fields ``change`` gives; ``None`` when it gives none."""
        values = {name: value for name, value in change.items() if value is not None}
        if not values:
            return None
        return lambda conn: repo.update_action(conn, action_id, values)

    @staticmethod
    def updating(action_id: int, **change: Unpack[ActionChange]) -> Callable[[Connection], None]:
        """The update of an action's given fields as a step of a caller's transaction."""
        step = ActionService._changing(action_id, change)
        return step if step is not None else lambda _conn: None

    async def update(self, action_id: int, **change: Unpack[ActionChange]) -> None:
        """Change the given fields of an action (no write when none is given)."""
        step = self._changing(action_id, change)
        if step is not None:
            await self._store.write(step)


__all__ = ["FINAL_STATUSES", "ActionChange", "ActionRow", "ActionService"]
