"""Which power caps are trainguard's own survives a controller restart.

A controller (the real composition: ``controller.runtime.compose``) caps a GPU through its
power loop on a real database (SQLite and PostgreSQL); a second one, built on the same
database as a restarted controller or a new leader would be, starts and must know the cap
as its own (the job detector's ``own_caps``: no "power throttling or capping" hardware
cause for it) and release it when the tree it loads leaves the server out. Before, both
lived only in the first controller's memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text

from controller.db.migrate import upgrade
from controller.db.repositories.nodes import node_row, upsert_nodes
from controller.loader import load_state
from controller.logic.detection.cause import OwnCap
from controller.runtime import compose
from controller.services.container import Services
from controller.services.power.loop import NodePower
from controller.settings import ControllerSettings
from controller.state import NodeState
from power import Decision, Knob, Level, Reading
from trainguard import wire

A100 = "NVIDIA A100-SXM4-80GB"
MAX_W = 400.0
#: The row is over T1 when s1 draws 900 W; s1 low priority, s2 high, caps by power limit.
POLICY = {"min_hold_s": 1.0, "knob": "power_limit"}


def tree_file(path: Path, servers: list[str]) -> Path:
    doc = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 1000,
        "policy": POLICY,
        "children": [{"name": s, "kind": "server", "budget_w": 5000} for s in servers],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def _noop(*_: object) -> None:
    return None


class Controller:
    """One controller process on the database: composed, led (state and tree loaded)."""

    def __init__(self, db_url: str, domains: Path) -> None:
        tokens = [{"name": "ops", "role": "operator", "token": "o" * 20}]
        settings = ControllerSettings(
            database_url=db_url, tokens=tokens, power_domains_file=domains
        )
        self.services: Services = compose(
            settings, on_elected=_noop, on_lost=_noop, acting=lambda: True
        )
        self.loop = self.services.power.loop

    async def start(self) -> None:
        """What ``Controller._lead`` does for the power side."""
        state = self.services.state
        await self.services.store.read(lambda session: load_state(session, state))
        await self.services.power.start()

    async def node(self, name: str, priority: str, *, limit_w: float | None = None) -> None:
        """A node as its reports leave it: its row, its state, its power inventory."""
        state = self.services.state
        if name not in state.nodes:
            state.nodes[name] = NodeState(name=name, first_seen_unix_s=1.0)
            row = node_row(state.nodes[name])
            await self.services.store.write(lambda conn: upsert_nodes(conn, [row]))
        gpu = wire.GpuInfo(
            index=0, uuid=f"GPU-{name}", name=A100, power_limit_min_w=100.0, power_limit_max_w=MAX_W
        )
        identity = wire.NodeIdentity(
            name=name, gpus=[gpu], labels={"trainguard.io/priority": priority}
        )
        sample = wire.NodeSample(
            time_unix_s=1.0,
            gpus=[wire.GpuSample(index=0, power_w=400.0, power_limit_w=limit_w or MAX_W)],
        )
        self.loop.nodes[name] = NodePower(identity=identity, sample=sample)

    def read(self, now: float, **power_w: float) -> None:
        for name, watts in power_w.items():
            self.loop.nodes[name].readings = {name: Reading(watts, now)}

    def sent(self, node: str) -> list[Any]:
        """The commands queued for ``node``, oldest first."""
        commands = self.services.state.commands.values()
        return sorted((c for c in commands if c.node == node), key=lambda c: c.created_unix_s)

    def ack(self, command_id: str, status: str, now: float) -> None:
        """The agent's acknowledgement, as ingest applies it to the command."""
        command = self.services.state.commands[command_id]
        command.status, command.finished_unix_s = status, now

    def own_cap(self, node: str, gpu: int) -> OwnCap | None:
        own_caps = self.services.jobs.own_caps
        assert own_caps is not None
        return own_caps(node, gpu)

    def close(self) -> None:
        self.services.store.close()


@pytest.fixture
def migrated(db_url: str) -> Iterator[str]:
    upgrade(db_url)
    yield db_url


async def _capped(c: Controller, now: float = 100.0) -> tuple[str, float]:
    """Tick the row over T1: s1 (low priority) gets a power limit. Its command id and limit."""
    await c.start()
    await c.node("s1", "low")
    await c.node("s2", "high")
    c.read(now, s1=900.0, s2=0.0)
    await c.loop.tick(now)
    [command] = c.sent("s1")
    assert command.kind == "set_power_limit", command
    return command.id, float(command.params["limit_w"])


@pytest.mark.parametrize("acked", [True, False], ids=["acknowledged", "never-acknowledged"])
def test_a_cap_set_before_a_restart_stays_ours_and_is_released_off_the_tree(
    migrated: str, tmp_path: Path, acked: bool
) -> None:
    """(1) and (4): the restarted controller knows the limit as its own, and the first tick
    of its policy releases it on s1, which the loaded tree leaves out. A cap whose command
    was never acknowledged (sent, maybe applied, its ack lost with the old controller)
    counts the same."""

    async def scenario() -> None:
        first = Controller(migrated, tree_file(tmp_path / "a.yaml", ["s1", "s2"]))
        try:
            cid, limit_w = await _capped(first)
            assert limit_w < MAX_W and first.own_cap("s1", 0) == OwnCap(limit_w=limit_w)
            if acked:
                first.ack(cid, "succeeded", 100.5)
                first.read(100.5, s1=800.0, s2=0.0)
                await first.loop.tick(100.5)
        finally:
            first.close()

        second = Controller(migrated, tree_file(tmp_path / "b.yaml", ["s2"]))
        try:
            await second.start()
            assert second.own_cap("s1", 0) == OwnCap(limit_w=limit_w)
            assert second.own_cap("s2", 0) == OwnCap(limit_w=None)
            # s1 still reports the limit in force; the tree has no domain for it.
            await second.node("s1", "low", limit_w=limit_w)
            await second.node("s2", "high")
            second.read(200.0, s2=10.0)
            known = set(second.services.state.commands)  # the first controller's, loaded
            await second.loop.tick(200.0)
            assert [c.kind for c in second.sent("s1") if c.id not in known] == ["reset_power_limit"]
            assert second.loop.released == {"s1:gpu0": "releasing"}
        finally:
            second.close()

    asyncio.run(scenario())


def test_an_uncap_after_the_cap_leaves_nothing_ours(migrated: str, tmp_path: Path) -> None:
    """(2): the newest action of the GPU is the uncap: not ours, nothing to release."""

    async def scenario() -> None:
        first = Controller(migrated, tree_file(tmp_path / "a.yaml", ["s1", "s2"]))
        try:
            await _capped(first)
            # The load drops: the agent applies each command; the policy lifts the cap
            # (perhaps through looser limits first) once its hold is over.
            now, last = 100.5, None
            while now < 160.0:
                last = first.sent("s1")[-1]
                if last.status == "pending":
                    first.ack(last.id, "succeeded", now)
                    limit_w = last.params.get("limit_w")
                    await first.node("s1", "low", limit_w=limit_w)
                    if last.kind == "reset_power_limit":
                        break
                first.read(now, s1=100.0, s2=0.0)
                await first.loop.tick(now)
                now += 0.5
            assert last is not None and last.kind == "reset_power_limit"
            await first.loop.tick(now)
            assert first.own_cap("s1", 0) == OwnCap(limit_w=None)
        finally:
            first.close()

        second = Controller(migrated, tree_file(tmp_path / "b.yaml", ["s2"]))
        try:
            await second.start()
            assert second.own_cap("s1", 0) == OwnCap(limit_w=None)
            assert second.loop.policy is not None and second.loop.policy.ours() == set()
        finally:
            second.close()

    asyncio.run(scenario())


def test_a_failed_cap_is_not_restored_but_the_one_before_it_holds(
    migrated: str, tmp_path: Path
) -> None:
    """(3): a cap the agent refused changed nothing: the newest action that may have
    changed the GPU is the one before it (here, none; on s2, the earlier cap)."""

    async def scenario() -> None:
        first = Controller(migrated, tree_file(tmp_path / "a.yaml", ["s1", "s2"]))
        try:
            cid, _ = await _capped(first)
            first.ack(cid, "failed", 100.5)
            first.read(100.5, s1=900.0, s2=0.0)
            await first.loop.tick(100.5)
            # Rows as the loop writes them, on s2: a cap that held, then one that failed.
            for limit_w, status in ((300.0, "succeeded"), (200.0, "failed")):
                action_id = await _stored(first, "s2", limit_w)
                await first.services.actions.update(action_id, status=status)
        finally:
            first.close()

        second = Controller(migrated, tree_file(tmp_path / "b.yaml", ["s1", "s2"]))
        try:
            await second.start()
            assert second.own_cap("s1", 0) == OwnCap(limit_w=None)
            assert second.own_cap("s2", 0) == OwnCap(limit_w=300.0)
        finally:
            second.close()

    asyncio.run(scenario())


async def _stored(c: Controller, node: str, limit_w: float | None) -> int:
    """A power-limit action row exactly as the loop writes it (``Planned.row``)."""
    command: wire.SetPowerLimit | wire.ResetPowerLimit = (
        wire.ResetPowerLimit(id="x", gpu_index=0)
        if limit_w is None
        else wire.SetPowerLimit(id="x", gpu_index=0, limit_w=limit_w)
    )
    decision = Decision(
        node=node, gpu_index=0, command=command, knob=Knob.POWER_LIMIT, domain="row-a",
        level=Level(1), threshold_frac=None, domain_power_w=None, budget_w=None, reason="test",
    )  # fmt: skip
    planned = c.loop.tracker.plan(decision, None, 50.0)
    return await c.services.actions.create(**planned.row("cmd-" + node))


def test_damaged_rows_do_not_break_the_start(
    migrated: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(5): rows an old release or a hand edit left are skipped with a warning; the others
    are restored and the controller starts."""

    async def scenario() -> None:
        first = Controller(migrated, tree_file(tmp_path / "a.yaml", ["s1", "s2"]))
        try:
            actions = first.services.actions
            await _stored(first, "s1", 250.0)
            damaged: list[tuple[str, str, Any]] = [
                ("power_cap", "s2:gpu0", {"knob": "power_limit"}),  # no limit_w
                ("power_cap", "s3:gpu0", {"knob": "power_limit", "limit_w": "lots"}),
                ("power_cap", "s4:gpu0", {"knob": 7, "limit_w": 250.0}),
                ("power_cap", "s5:gpu0", {}),
                ("power_cap", "not-a-gpu", {"knob": "power_limit", "limit_w": 250.0}),
                ("power_cap", "s6:gpu0", ["power_limit", 250.0]),
                ("power_cap", "s7:gpu0", {"knob": "power_limit", "limit_w": None}),
                ("power_cap", "s9:gpu0", {"knob": ["power_limit"], "limit_w": 250.0}),
                ("power_cap", "s10:gpu0", {"knob": "power_limit", "limit_w": -5.0}),
            ]
            for kind, target, params in damaged:
                await actions.create(kind=kind, target=target, trigger="power:x", params=params)
            if first.services.store.kind == "sqlite":  # a JSON column on PostgreSQL refuses it
                bad = await _stored(first, "s8", 250.0)
                await first.services.store.write(
                    lambda conn: conn.execute(
                        text("UPDATE actions SET params = :p WHERE id = :i"),
                        {"p": "{not json", "i": bad},
                    )
                )
        finally:
            first.close()

        second = Controller(migrated, tree_file(tmp_path / "b.yaml", ["s2"]))
        try:
            with caplog.at_level(logging.WARNING, "controller.services.power.tracking"):
                await second.start()
            assert second.loop.policy is not None
            assert second.own_cap("s1", 0) == OwnCap(limit_w=250.0)
            for node in ("s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10"):
                assert second.own_cap(node, 0) == OwnCap(limit_w=None), node
            assert second.loop.policy.ours() == {("s1", 0)}
            skipped = [r for r in caplog.records if "not understood" in r.getMessage()]
            assert len(skipped) == len(damaged)
        finally:
            second.close()

    asyncio.run(scenario())
