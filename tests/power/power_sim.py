"""For the pure power policy's tests: a row of servers, and stand-in agents that execute
and acknowledge its commands and report back what is in force, as the next report's
GpuStatus would (the lock they set, the limit NVML reads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from power.domains import DomainTree, Reading, parse_domains
from power.policy import Decision, GpuStatus, PowerPolicy, TickResult
from trainguard.wire import (
    CommandAck,
    CommandStatus,
    LockClocks,
    ResetPowerLimit,
    SetPowerLimit,
    UnlockClocks,
)

#: The row's budget and the policy's hold time in :func:`row`.
BUDGET = 1000.0
HOLD_S = 10.0


def row(
    servers: Sequence[str] = ("s1", "s2", "s3"),
    *,
    budget_w: float = BUDGET,
    policy: dict[str, Any] | None = None,
) -> DomainTree:
    """A row straight over its servers (server budgets never bind)."""
    return parse_domains(
        {
            "name": "row-a",
            "kind": "row",
            "budget_w": budget_w,
            "policy": {"min_hold_s": HOLD_S, **(policy or {})},
            "children": [{"name": s, "kind": "server", "budget_w": 5000} for s in servers],
        }
    )


class Agents:
    def __init__(self, policy: PowerPolicy, gpus: Sequence[GpuStatus]) -> None:
        self.policy = policy
        self.gpus = {(g.server, g.index): g for g in gpus}
        self.acks: list[CommandAck] = []
        self.sent: list[Decision] = []
        self.ignore: set[str] = set()
        """Servers that ack success and change nothing (a cap that does not take)."""
        self.fail: set[str] = set()
        """Command kinds that fail (no permission), acked FAILED and changing nothing."""

    def tick(self, now: float, readings: dict[str, Reading]) -> TickResult:
        result = self.policy.tick(now, readings, list(self.gpus.values()), self.acks)
        self.acks = []
        for d in result.decisions:
            self.sent.append(d)
            cmd = d.command
            if cmd.kind in self.fail:
                self.acks.append(
                    CommandAck(
                        command_id=cmd.id,
                        status=CommandStatus.FAILED,
                        reason="Insufficient Permissions",
                        finished_unix_s=now,
                    )
                )
                continue
            if d.node not in self.ignore:
                self._apply(d)
            self.acks.append(
                CommandAck(command_id=cmd.id, status=CommandStatus.SUCCEEDED, finished_unix_s=now)
            )
        return result

    def _apply(self, d: Decision) -> None:
        key = (d.node, d.gpu_index)
        cmd, g = d.command, self.gpus[key]
        if isinstance(cmd, LockClocks):
            g = dataclasses.replace(g, locked_sm_clock_mhz=cmd.max_mhz)
        elif isinstance(cmd, UnlockClocks):
            g = dataclasses.replace(g, locked_sm_clock_mhz=None)
        elif isinstance(cmd, SetPowerLimit):
            g = dataclasses.replace(g, power_limit_w=cmd.limit_w)
        elif isinstance(cmd, ResetPowerLimit):
            g = dataclasses.replace(g, power_limit_w=g.power_limit_max_w)
        self.gpus[key] = g

    def kinds(self, since: int = 0) -> list[tuple[str, str]]:
        return [(d.node, d.command.kind) for d in self.sent[since:]]

    def clock(self, server: str, index: int = 0) -> int | None:
        return self.gpus[(server, index)].locked_sm_clock_mhz
