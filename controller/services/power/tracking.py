"""Bookkeeping of the policy's Actions: created with the command, finished with its ack,
completed with the power effect the readings showed.

One action per command (per GPU and knob). Its ``params`` carry what an operator needs to
judge it: the knob and target (clock or limit), the domain, level and threshold that
caused it, the domain's power before; then the domain's power after and how long after the
command the readings showed it (``reflected_after_s``: the first complete reading that
moved by ``EFFECT_DELTA_FRAC`` of the budget the expected way; ``None`` when none did
within ``EFFECT_TIMEOUT_S``, e.g. an uncap on an idle server), and, when a level change
of a domain above caused it, that change's effect as the policy measured it
(``level_change``).
"""

from __future__ import annotations

import logging
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from controller.db.repositories.actions import PowerActionRow
from controller.services.actions import ActionService
from controller.state import CommandState
from power import ActuationEffect, Decision, DomainStatus, DomainTree, Knob
from power.tick_io import EFFECT_DELTA_FRAC, EFFECT_TIMEOUT_S
from trainguard.wire import LockClocks, SetPowerLimit

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    action_id: int
    node: str
    created_unix_s: float
    params: dict[str, Any]
    command_id: str | None
    domain: str | None
    budget_w: float | None
    power_before_w: float | None
    up: bool
    """Expected direction of the domain's power: up after an uncap or a looser cap."""
    command_done: bool = False
    effect_done: bool = False
    level_done: bool = False


def action_kind(decision: Decision) -> str:
    return (
        "power_cap" if isinstance(decision.command, LockClocks | SetPowerLimit) else "power_uncap"
    )


def decision_params(decision: Decision, power_before_w: float | None) -> dict[str, Any]:
    cmd = decision.command
    params: dict[str, Any] = {
        "knob": decision.knob.value,
        "command": cmd.kind,
        "domain": decision.domain,
        "level": decision.level.name,
        "threshold_frac": decision.threshold_frac,
        "budget_w": decision.budget_w,
        "power_before_w": None if power_before_w is None else round(power_before_w, 1),
        "reason": decision.reason,
    }
    if isinstance(cmd, LockClocks):
        params["clock_mhz"] = cmd.max_mhz
        params["clock_min_mhz"] = cmd.min_mhz
    elif isinstance(cmd, SetPowerLimit):
        params["limit_w"] = round(cmd.limit_w, 1)
    return params


@dataclass(slots=True)
class Planned:
    """A decision's action as it will be written: nothing in memory changes until its row
    (and its command's) is stored (:meth:`ActionTracker.publish`)."""

    decision: Decision
    params: dict[str, Any]
    key: tuple[str, int, str]
    target: float | None
    up: bool
    domain: str | None
    budget_w: float | None
    power_before_w: float | None
    now: float

    def row(self, command_id: str | None, failed: str | None = None) -> dict[str, Any]:
        """The action row's fields (:meth:`ActionService.create`'s arguments)."""
        decision = self.decision
        return {
            "kind": action_kind(decision),
            "target": f"{decision.node}:gpu{decision.gpu_index}",
            "trigger": f"power:{decision.domain or '-'}:{decision.level.name.lower()}",
            "params": {**self.params, "command_id": command_id},
            "status": "failed" if failed else "pending",
            "outcome": failed or "",
            "created_unix_s": self.now,
        }

    def inserting(self, command: CommandState) -> Callable[[Connection], int]:
        """The action row's insert, as a step of its command's transaction."""
        return ActionService.inserting(**self.row(command.id))


#: Level changes whose effect could not be written yet, kept for later ticks (oldest dropped).
MAX_UNWRITTEN_EFFECTS = 64


class ActionTracker:
    """Write, then publish: each action's row, and each update of it, is stored before the
    tracker's memory (targets sent, what is done) changes, so a write that fails is tried
    again by a later tick and nothing is marked done that the database does not hold."""

    def __init__(self, actions: ActionService) -> None:
        self._actions = actions
        self.open: list[_Open] = []
        #: Last target sent per (node, GPU, knob); None = uncapped.
        self._targets: dict[tuple[str, int, str], float | None] = {}
        #: Level changes not yet written onto every action they cover.
        self._effects: deque[tuple[ActuationEffect, DomainTree]] = deque(
            maxlen=MAX_UNWRITTEN_EFFECTS
        )

    def power_limit_w(self, node: str, gpu: int) -> float | None:
        """The power limit this policy last sent ``node``'s GPU ``gpu`` (``None``: none, or
        lifted): what makes a GPU's ``sw_power_cap`` trainguard's own, not a fault (the
        straggler cause, docs/detection.md). Filled by :meth:`publish` as caps are sent, and
        at a controller start by :meth:`restore` from the ``actions`` table, so a cap set
        before a restart (a new leader, a crash, an upgrade) stays trainguard's own."""
        return self._targets.get((node, gpu, Knob.POWER_LIMIT.value))

    def restore(self, rows: Iterable[PowerActionRow]) -> set[tuple[str, int]]:
        """Take back the targets of the newest power action per (target, knob) a previous
        controller stored (:func:`~controller.db.repositories.actions.latest_power_actions`)
        and return the GPUs whose caps may still be in force: the ``ours`` of the first
        policy, which releases them on servers the tree leaves out.

        An action still ``pending`` counts like a succeeded one: its command was stored
        and may have been delivered and applied, its ack lost with the old controller.
        Counting it ours costs nothing if it never landed (the policy releases only a GPU
        that shows a cap, and the job detector excuses only a GPU held at that very
        limit); counting it foreign would leave a cap of ours on a server outside the tree
        for good and blame the hardware for it. A pending *uncap* keeps its GPU in ``ours`` for the
        same reason (the cap may still be there; the policy releases only a GPU that still
        shows one), while its target is ``None``. Rows the tracker cannot read (no knob, a
        target that is not ``node:gpuN``, a cap without its number) are skipped with a
        warning: a start never fails on an old row."""
        ours: set[tuple[str, int]] = set()
        skipped = 0
        for row in rows:
            parsed = _restored(row)
            if parsed is None:
                skipped += 1
                log.warning(
                    "power: stored action not understood; its cap is not restored",
                    extra={"fields": {"action": row.id, "target": row.target[:80]}},
                )
                continue
            key, target = parsed
            self._targets[key] = target
            if target is not None or row.status == "pending":
                ours.add((key[0], key[1]))
        if ours or skipped:
            log.info(
                "power: caps restored from stored actions",
                extra={"fields": {"gpus": len(ours), "skipped": skipped}},
            )
        return ours

    def plan(self, decision: Decision, domain: DomainStatus | None, now: float) -> Planned:
        """The action of ``decision``; memory is not changed."""
        power_before_w = None if domain is None else domain.power_w
        target = _target(decision)
        key = (decision.node, decision.gpu_index, decision.knob.value)
        previous = self._targets.get(key)
        return Planned(
            decision=decision,
            params=decision_params(decision, power_before_w),
            key=key,
            target=target,
            up=target is None or (previous is not None and target > previous),
            domain=decision.domain,
            budget_w=None if domain is None else domain.budget_w,
            power_before_w=power_before_w,
            now=now,
        )

    def publish(self, planned: Planned, action_id: int, command_id: str) -> None:
        """The command and its action row are stored: track the action."""
        self._targets[planned.key] = planned.target
        self.open.append(
            _Open(
                action_id,
                planned.decision.node,
                planned.now,
                {**planned.params, "command_id": command_id},
                command_id,
                planned.domain,
                planned.budget_w,
                planned.power_before_w,
                planned.up,
            )
        )

    async def record_failed(self, planned: Planned, failed: str) -> None:
        """A decision whose command could never be created: its ``failed`` row only."""
        await self._actions.create(**planned.row(None, failed))

    async def on_statuses(self, statuses: Mapping[str, DomainStatus], now: float) -> None:
        """Power after: the first complete reading of the action's domain that moved."""
        for entry in self.open:
            if entry.effect_done or entry.domain is None or entry.power_before_w is None:
                continue
            st = statuses.get(entry.domain)
            if st is None or entry.budget_w is None:
                continue
            delta = EFFECT_DELTA_FRAC * entry.budget_w
            before = entry.power_before_w
            moved = st.power_w >= before + delta if entry.up else st.power_w <= before - delta
            timed_out = now - entry.created_unix_s >= EFFECT_TIMEOUT_S
            if not ((st.complete and moved) or timed_out):
                continue
            observed = st.complete and moved
            params = {
                **entry.params,
                "power_after_w": round(st.power_w, 1),
                "effect_observed": observed,
                "reflected_after_s": round(now - entry.created_unix_s, 3) if observed else None,
            }
            await self._actions.update(entry.action_id, params=params)
            entry.params, entry.effect_done = params, True

    async def on_commands(self, commands: Mapping[str, CommandState], now: float) -> None:
        """Finish actions whose command reached a final status."""
        for entry in self.open:
            if entry.command_done or entry.command_id is None:
                continue
            command = commands.get(entry.command_id)
            if command is None:
                status, outcome, done = "failed", "command forgotten before an ack", now
            elif command.status in ("pending", "sent"):
                continue
            else:
                status = "succeeded" if command.status == "succeeded" else "failed"
                outcome = command.reason or command.status
                done = command.finished_unix_s or now
            params = {
                **entry.params,
                "command_status": command.status if command else "forgotten",
                "command_latency_s": round(max(0.0, done - entry.created_unix_s), 3),
            }
            await self._actions.update(
                entry.action_id,
                params=params,
                status=status,
                outcome=outcome[:2000],
                finished_unix_s=done,
            )
            entry.params, entry.command_done = params, True
        await self._forget(now)

    async def on_effects(self, effects: list[ActuationEffect], tree: DomainTree) -> None:
        """Write each level change's effect onto the actions issued since it; the policy
        reports an effect once, so one not yet written everywhere is kept for later ticks."""
        dropped = len(self._effects) + len(effects) - MAX_UNWRITTEN_EFFECTS
        if dropped > 0:  # the deque keeps the newest
            log.error(
                "power level-change effects not written, dropped", extra={"fields": {"n": dropped}}
            )
        self._effects.extend((effect, tree) for effect in effects)
        while self._effects:
            effect, at = self._effects[0]
            for entry in self.open:
                if entry.level_done or entry.created_unix_s < effect.started_s - 1e-6:
                    continue
                if not _covers(at, effect.domain, entry.node):
                    continue
                params = {
                    **entry.params,
                    "level_change": {
                        "domain": effect.domain,
                        "from": effect.from_level.name,
                        "to": effect.to_level.name,
                        "power_before_w": round(effect.power_before_w, 1),
                        "power_after_w": round(effect.power_after_w, 1),
                        "observed": effect.observed,
                        "latency_s": round(effect.latency_s, 3) if effect.observed else None,
                    },
                }
                await self._actions.update(entry.action_id, params=params)
                entry.params, entry.level_done = params, True
            self._effects.popleft()  # written everywhere it applies (a failure keeps it)

    async def _forget(self, now: float) -> None:
        keep = []
        for entry in self.open:
            expired = now - entry.created_unix_s > EFFECT_TIMEOUT_S + 60.0
            if entry.command_done and ((entry.effect_done and entry.level_done) or expired):
                continue
            if expired and not entry.command_done:
                continue  # the command service expires it; stop tracking
            keep.append(entry)
        self.open = keep


def _target(decision: Decision) -> float | None:
    cmd = decision.command
    if isinstance(cmd, LockClocks):
        return float(cmd.max_mhz)
    if isinstance(cmd, SetPowerLimit):
        return cmd.limit_w
    return None


#: A stored action's target: the node (wire.NAME_PATTERN has no colon) and the GPU index.
_TARGET = re.compile(r"^(?P<node>[^:]+):gpu(?P<index>[0-9]{1,4})$")
#: The params key holding a cap's value, per knob (:func:`decision_params`).
_VALUE_KEY = {Knob.CLOCKS.value: "clock_mhz", Knob.POWER_LIMIT.value: "limit_w"}


def _restored(row: PowerActionRow) -> tuple[tuple[str, int, str], float | None] | None:
    """(node, GPU, knob) and target of a stored action (None: an uncap); None when the row
    is not one :class:`ActionTracker` could have written."""
    match = _TARGET.match(row.target)
    params = row.params
    if match is None or not isinstance(params, dict):
        return None
    knob = params.get("knob")
    if not isinstance(knob, str) or knob not in _VALUE_KEY:
        return None
    key = (match["node"], int(match["index"]), str(knob))
    if row.kind == "power_uncap":
        return key, None
    value = params.get(_VALUE_KEY[knob])
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return key, float(value)


def _covers(tree: DomainTree, domain: str, node: str) -> bool:
    """Whether ``domain`` is the node's server, above it, or one of its GPUs."""
    server = tree.by_name.get(node)
    dom = tree.by_name.get(domain)
    if server is None or dom is None:
        return False
    return dom in server.ancestors() or dom.parent is server


__all__ = ["ActionTracker", "Planned", "action_kind", "decision_params"]
