"""The power action tracker: level-change effects kept until written, the oldest dropped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from controller.services.power.tracking import MAX_UNWRITTEN_EFFECTS, ActionTracker, _Open
from power import ActuationEffect
from power.config import Level
from power.domains import parse_domains

TREE = parse_domains(
    {
        "name": "row-a",
        "kind": "row",
        "budget_w": 1000,
        "children": [{"name": "s1", "kind": "server", "budget_w": 900}],
    }
)


class Actions:
    """ActionService's update, failing while ``down``."""

    def __init__(self) -> None:
        self.down = True
        self.updates: list[tuple[int, dict[str, Any]]] = []

    async def update(self, action_id: int, *, params: dict[str, Any]) -> None:
        if self.down:
            raise RuntimeError("database unavailable")
        self.updates.append((action_id, params))


def _effect(i: int) -> ActuationEffect:
    return ActuationEffect("row-a", Level.NONE, Level.T1, 10.0 + i, float(i), 0.0, False, 0.0)


def test_an_unwritten_effect_is_kept_for_a_later_tick_and_the_oldest_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    actions = Actions()
    tracker = ActionTracker(actions)  # type: ignore[arg-type]
    tracker.open = [_Open(7, "s1", 100.0, {"k": 1}, "c1", "row-a", 1000.0, 900.0, False)]
    extra = 2
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        asyncio.run(
            tracker.on_effects([_effect(i) for i in range(MAX_UNWRITTEN_EFFECTS + extra)], TREE)
        )
    (dropped,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped.fields == {"n": extra}  # type: ignore[attr-defined]
    actions.down = False
    asyncio.run(tracker.on_effects([], TREE))
    # The oldest effect kept, the one that failed, is written; the entry then has its own.
    assert [(i, p["level_change"]["power_before_w"]) for i, p in actions.updates] == [
        (7, float(extra))
    ]
    assert actions.updates[0][1]["k"] == 1
    # Every kept effect was gone through: a new action finds none left to take.
    actions.updates.clear()
    tracker.open.append(_Open(8, "s1", 200.0, {}, "c2", "row-a", 1000.0, 900.0, False))
    asyncio.run(tracker.on_effects([], TREE))
    assert actions.updates == []
    asyncio.run(tracker.on_effects([_effect(99)], TREE))
    assert [(i, p["level_change"]["power_before_w"]) for i, p in actions.updates] == [(8, 99.0)]
