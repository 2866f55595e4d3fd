"""Commands for node agents: queue, deliver in the next ``ReportReply``, track acks, expire.

Lifecycle: ``pending`` (queued, durable) -> ``sent`` (handed out in a reply, written in the
same transaction as the report it answers) -> ``succeeded`` / ``failed`` / ``relayed`` (from
the agent's ack) or ``expired`` (no ack within ``command_expire_after_s`` of queueing).
A reply whose report fails to commit puts its commands back to ``pending``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import TypeAdapter
from sqlalchemy import Connection

from controller.db.keys import CommandKey
from controller.db.repositories import commands as repo_commands
from controller.errors import InvalidInput, NotFound
from controller.logic.remediation.preflight import (
    FinishedCommand,
    PreflightVerdict,
    latest_verdicts,
)
from controller.state import ClusterState, CommandState
from controller.validation import first_unstorable
from controller.writer import GroupCommitWriter
from trainguard import wire

log = logging.getLogger(__name__)

_COMMAND = TypeAdapter(wire.Command)

#: Finished commands stay in memory this long (their final row must reach the database).
KEEP_FINISHED_S = 300.0

FINAL = frozenset({"succeeded", "failed", "relayed", "expired"})

T = TypeVar("T")


def to_wire(command: CommandState) -> wire.Command:
    return _COMMAND.validate_python(
        {
            **command.params,
            "id": command.id,
            "kind": command.kind,
            "issued_unix_s": command.created_unix_s,
        }
    )


class CommandService:
    def __init__(
        self, state: ClusterState, writer: GroupCommitWriter, *, expire_after_s: float
    ) -> None:
        self._state = state
        self._writer = writer
        self.expire_after_s = expire_after_s
        self.tick_interval_s = min(5.0, expire_after_s / 4)
        #: Each node's last preflight verdict, kept after its command leaves memory.
        self._preflight: dict[str, PreflightVerdict] = {}

    def preflight_verdicts(self) -> dict[str, PreflightVerdict]:
        """Each node's last preflight verdict (placement keeps nodes that failed out)."""
        self._preflight = latest_verdicts(
            self._preflight,
            (
                FinishedCommand(
                    node=c.node,
                    kind=c.kind,
                    status=c.status,
                    reason=c.reason,
                    finished_unix_s=c.finished_unix_s,
                )
                for c in self._state.commands.values()
            ),
        )
        return dict(self._preflight)

    async def create(self, node_name: str, request: wire.CommandBase, *, by: str) -> CommandState:
        command, _ = await self.create_with(node_name, request, by=by, also=None)
        return command

    async def create_with(
        self,
        node_name: str,
        request: wire.CommandBase,
        *,
        by: str,
        also: Callable[[CommandState], Callable[[Connection], T]] | None,
    ) -> tuple[CommandState, T | None]:
        """Create a command and write ``also(command)``'s step (an audit row that names the
        command) in the same transaction: a command is never queued without its record,
        nor the record stored for a command that was never queued."""
        node = self._state.nodes.get(node_name)
        if node is None:
            raise NotFound(f"node {node_name!r} not found; it appears after its first report")
        gpu_index = getattr(request, "gpu_index", None)
        if gpu_index is not None and node.gpus and gpu_index not in node.gpus:
            raise InvalidInput(
                f"body.gpu_index: node {node_name!r} has no GPU {gpu_index} "
                f"(it has {sorted(node.gpus)})"
            )
        problem = first_unstorable(request, "body")
        if problem is not None:
            raise InvalidInput(problem)
        now = time.time()
        params: dict[str, Any] = request.model_dump(
            mode="json", exclude={"id", "kind", "issued_unix_s"}
        )
        command = CommandState(
            id=uuid.uuid4().hex,
            node=node_name,
            kind=str(getattr(request, "kind", "")),
            params=params,
            created_unix_s=now,
        )
        to_wire(command)  # proves the agent will be able to parse it
        # Write, then publish: a command the database refused was never handed to an agent.
        row = repo_commands.command_row(command)
        step = None if also is None else also(command)

        def write(conn: Connection) -> T | None:
            repo_commands.upsert_commands(conn, [row])
            return None if step is None else step(conn)

        result = await self._writer.run(write)
        self._state.commands[command.id] = command
        log.info(
            "command queued",
            extra={
                "fields": {"command": command.id, "node": node_name, "kind": command.kind, "by": by}
            },
        )
        return command, result

    async def tick(self, now_unix_s: float) -> None:
        """Expire unacknowledged commands and forget finished ones."""
        expired: list[tuple[CommandState, str]] = []
        self.preflight_verdicts()  # take the verdicts before their commands are forgotten
        for command in list(self._state.commands.values()):
            if command.status in FINAL:
                done = command.finished_unix_s or command.created_unix_s
                if now_unix_s - done > KEEP_FINISHED_S:
                    del self._state.commands[command.id]
                continue
            if now_unix_s - command.created_unix_s > self.expire_after_s:
                reason = (
                    f"no acknowledgement within {self.expire_after_s:g} s "
                    f"(was {'delivered' if command.sent_unix_s else 'never delivered'})"
                )
                expired.append((command, reason))
        if not expired:
            return
        # Write, then publish: memory says "expired" only once the database does.
        rows = [
            repo_commands.command_row(
                dataclasses.replace(c, status="expired", reason=r, finished_unix_s=now_unix_s)
            )
            for c, r in expired
        ]
        await self._writer.run(lambda conn: repo_commands.upsert_commands(conn, rows))
        for command, reason in expired:
            if command.status in FINAL:  # acknowledged while we wrote: the ack wins
                continue
            command.status, command.reason = "expired", reason
            command.finished_unix_s = now_unix_s
            log.warning(
                "command expired",
                extra={"fields": {"command": command.id, "node": command.node}},
            )
        # A report may have delivered or acknowledged one of them while we wrote; write
        # what memory now says once more, so the last row stored is the one shown.
        self._writer.mark_dirty({CommandKey(c.id) for c, _ in expired})
