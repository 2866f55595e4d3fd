"""ActionService: a row's insert and its updates, written at once or as a caller's step."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.migrate import upgrade
from controller.db.models import Action
from controller.db.session import make_engine
from controller.services.actions import ActionService
from controller.services.operator_actions import isolation_audit
from controller.store import Store


def _rows(store: Store) -> list[tuple[str, str, str | None, dict[str, object], float | None]]:
    with Session(store.engine) as s:
        return [
            (a.kind, a.status, a.outcome, dict(a.params), a.finished_unix_s)
            for a in s.scalars(select(Action).order_by(Action.id))
        ]


def _store(tmp_path: Path) -> Store:
    url = f"sqlite:///{tmp_path / 'tg.db'}"
    upgrade(url)
    return Store(make_engine(url))


def test_create_update_and_a_change_of_nothing_writes_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    actions = ActionService(store)

    async def scenario() -> None:
        pending = await actions.create(kind="isolate_node", target="n1", trigger="t", params={})
        done = await actions.create(
            kind="k" * 80, target="n2", trigger="t", params={"a": 1}, status="skipped"
        )
        first, second = _rows(store)
        assert first == ("isolate_node", "pending", "", {}, None)
        assert second[:4] == ("k" * 64, "skipped", "", {"a": 1})
        assert second[4] is not None  # a final status ends the row at once
        commits = store.commits
        await actions.update(pending)
        await actions.update(pending, params=None, status=None)
        assert store.commits == commits  # nothing to change: no transaction
        await store.write(actions.updating(done))  # a step that changes nothing
        await actions.update(pending, status="succeeded", outcome="ok", finished_unix_s=5.0)
        await store.write(actions.updating(done, params={"b": 2}))

    asyncio.run(scenario())
    first, second = _rows(store)
    assert first == ("isolate_node", "succeeded", "ok", {}, 5.0)
    assert second[:4] == ("k" * 64, "skipped", "", {"b": 2})


def test_an_isolation_by_hand_is_recorded_as_the_operator_asked_it(tmp_path: Path) -> None:
    """One row builder for the isolate/release API and an approved dry-run isolation: the
    row names who asked and why, the actuator that acted, and is dated when asked."""
    store = _store(tmp_path)
    actions = ActionService(store)
    engine: Any = SimpleNamespace(actuator=SimpleNamespace(name="kubernetes"))
    asked = time.time()
    isolate = isolation_audit(actions, engine, "n3", "alice", "suspect")
    release = isolation_audit(actions, engine, "n3", "bob", "repaired", isolate=False)
    answered = time.time()

    async def write() -> None:
        await asyncio.sleep(0.05)  # the isolation itself
        await store.write(isolate(True, "isolated n3"))
        engine.actuator = None
        await store.write(release(False, "uncordon refused"))

    asyncio.run(write())
    with Session(store.engine) as s:
        rows = [
            (a.kind, a.target, a.trigger, dict(a.params), a.status, a.outcome, a.created_unix_s)
            for a in s.scalars(select(Action).order_by(Action.id))
        ]
    assert [r[:6] for r in rows] == [
        ("isolate_node", "n3", "operator:alice", {"reason": "suspect", "actuator": "kubernetes"},
         "succeeded", "isolated n3"),
        ("release_node", "n3", "operator:bob", {"reason": "repaired", "actuator": None},
         "failed", "uncordon refused"),
    ]  # fmt: skip
    assert all(asked <= r[6] <= answered for r in rows)
