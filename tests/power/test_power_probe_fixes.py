"""Fixes for what the power acceptance probe found.

* F1: a server dropped from the tree kept the caps trainguard set on it for good (the new
  policy skipped nodes outside every domain and forgot the old policy's caps);
* F2: a table row's clock range won over the range the GPU reports (an H100 PCIe at 1755 MHz
  got an 1800 MHz lock, an A100 with a 1300 MHz floor got locks below it);
* F3: inverted power-limit bounds (min > max) gave a limit above the maximum;
* F4: clock overrides took any positive integer (1 MHz, 99999 MHz).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import pytest

from controller.services.power.loop import NodePower, PowerLoop
from controller.state import ClusterState
from power.clocks import clock_profile
from power.config import Priority
from power.domains import DomainTree, Reading, parse_domains
from power.errors import ConfigError
from power.policy import GpuStatus, PowerPolicy, TickResult
from trainguard import wire
from trainguard.wire import (
    CommandAck,
    CommandStatus,
    LockClocks,
    ResetPowerLimit,
    SetPowerLimit,
    UnlockClocks,
)

A100 = "NVIDIA A100-SXM4-80GB"
POLICY = {"min_hold_s": 1.0}


def row(servers: list[str], policy: dict[str, Any] | None = None) -> DomainTree:
    return parse_domains(
        {
            "name": "row-a",
            "kind": "row",
            "budget_w": 1000,
            "policy": {**POLICY, **(policy or {})},
            "children": [{"name": s, "kind": "server", "budget_w": 5000} for s in servers],
        }
    )


def lp(server: str = "s1", **kw: Any) -> GpuStatus:
    return GpuStatus(server=server, index=0, model=A100, priority=Priority.LOW, **kw)


def ok(result: TickResult, now: float) -> list[CommandAck]:
    return [
        CommandAck(command_id=d.command.id, status=CommandStatus.SUCCEEDED, finished_unix_s=now)
        for d in result.decisions
    ]


# ---------------------------------------------------------------------------- F1


def capped_under_a() -> PowerPolicy:
    a = PowerPolicy(row(["s1", "s2"]))
    first = a.tick(0.0, {"s1": Reading(900, 0.0), "s2": Reading(0, 0.0)}, [lp()])
    assert [type(d.command) for d in first.decisions] == [LockClocks]
    a.tick(0.5, {}, [lp()], ok(first, 0.5))
    return a


def test_a_server_the_new_tree_leaves_out_gets_the_cap_we_set_released() -> None:
    a = capped_under_a()
    assert a.ours() == {("s1", 0)}
    b = PowerPolicy(row(["s2"]), ours=a.ours())
    locked = lp(locked_sm_clock_mhz=1110)
    r = b.tick(1.0, {"s2": Reading(10, 1.0)}, [locked])
    assert [(d.node, type(d.command)) for d in r.decisions] == [("s1", UnlockClocks)]
    assert "in no power domain of the current tree" in r.decisions[0].reason
    assert r.decisions[0].domain is None
    assert b.released() == {"s1:gpu0": "releasing"}
    # Acknowledged: released, and nothing more is sent while the agent catches up.
    b.tick(2.0, {"s2": Reading(10, 2.0)}, [locked], ok(r, 2.0))
    assert b.released() == {"s1:gpu0": "released"}
    for t in range(3, 30):
        again = b.tick(float(t), {"s2": Reading(10, float(t))}, [lp()])
        assert again.decisions == []
    assert b.ours() == set()


def test_a_lowered_power_limit_is_reset_too_and_foreign_caps_are_left_alone() -> None:
    limited = lp(power_limit_min_w=100, power_limit_max_w=400, power_limit_w=250)
    other = GpuStatus(server="s9", index=0, model=A100, locked_sm_clock_mhz=900)
    b = PowerPolicy(row(["s2"]), ours={("s1", 0)})
    r = b.tick(1.0, {"s2": Reading(10, 1.0)}, [limited, other])
    assert [(d.node, type(d.command)) for d in r.decisions] == [("s1", ResetPowerLimit)]
    # s9 was never capped by trainguard (an operator's lock): not ours to lift.
    assert set(b.released()) == {"s1:gpu0"}


def test_an_uncapped_server_outside_the_tree_gets_nothing() -> None:
    b = PowerPolicy(row(["s2"]), ours={("s1", 0)})
    assert b.tick(1.0, {"s2": Reading(10, 1.0)}, [lp()]).decisions == []
    assert b.released() == {}


class _Commands:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def create_with(self, node: str, command: Any, **_: Any) -> tuple[Any, int]:
        self.sent.append((node, command))
        return SimpleNamespace(id=f"c{len(self.sent)}"), len(self.sent)


def _node(name: str, locked: int | None, priority: str = "low") -> NodePower:
    gpu = wire.GpuInfo(index=0, uuid=f"GPU-{name}", name=A100)
    identity = wire.NodeIdentity(name=name, gpus=[gpu], labels={"trainguard.io/priority": priority})
    sample = wire.NodeSample(
        time_unix_s=1.0,
        gpus=[wire.GpuSample(index=0, power_w=400.0, locked_sm_clock_mhz=locked)],
    )
    return NodePower(identity=identity, sample=sample)


def test_the_loop_releases_caps_when_the_tree_is_replaced() -> None:
    incidents = AsyncMock()
    incidents.find_open = MagicMock(return_value=None)
    commands = _Commands()
    loop = PowerLoop(ClusterState(), commands, incidents, AsyncMock())  # type: ignore[arg-type]
    loop.tracker = MagicMock()
    loop.tracker.on_effects = AsyncMock()
    loop.tracker.on_statuses = AsyncMock()
    loop.tracker.on_commands = AsyncMock()
    loop.set_tree(row(["s1", "s2"]))
    loop.nodes["s1"] = _node("s1", None)
    loop.nodes["s2"] = _node("s2", None, "high")
    loop.nodes["s1"].readings = {"s1": Reading(900.0, 100.0)}
    loop.nodes["s2"].readings = {"s2": Reading(0.0, 100.0)}
    asyncio.run(loop.tick(100.0))
    assert [(n, type(c)) for n, c in commands.sent] == [("s1", LockClocks)]
    # The agent reports the lock; tree B drops s1.
    loop.nodes["s1"] = _node("s1", commands.sent[0][1].max_mhz)
    loop.nodes["s2"].readings = {"s2": Reading(10.0, 101.0)}
    loop.set_tree(row(["s2"]))
    asyncio.run(loop.tick(101.0))
    assert [(n, type(c)) for n, c in commands.sent[1:]] == [("s1", UnlockClocks)]
    assert loop.released == {"s1:gpu0": "releasing"}


# ---------------------------------------------------------------------------- F2


def test_the_reported_clock_range_narrows_a_table_row() -> None:
    pcie = clock_profile("NVIDIA H100 PCIe", sm_clock_max_mhz=1755)
    assert pcie is not None and pcie.max_mhz == 1755 and pcie.clocks_usable
    assert all(345 <= mhz <= 1755 for mhz in pcie.caps_mhz.values())
    assert pcie.caps_mhz["lp_t1"] < 1755  # still a cap, placed in the real range
    floor = clock_profile(A100, sm_clock_min_mhz=1300, sm_clock_max_mhz=1410)
    assert floor is not None and floor.min_mhz == 1300
    assert all(1300 <= mhz <= 1410 for mhz in floor.caps_mhz.values())
    # The table row as it was when the report agrees with it.
    assert clock_profile(A100, sm_clock_max_mhz=1410) == clock_profile(A100)


@pytest.mark.parametrize(
    ("status", "lo", "hi"),
    [
        (GpuStatus(server="s1", index=0, model="NVIDIA H100 PCIe", sm_clock_max_mhz=1755), 0, 1755),
        (lp(sm_clock_min_mhz=1300, sm_clock_max_mhz=1410), 1300, 1410),
    ],
)
@pytest.mark.parametrize("frac", [0.85, 0.96, 1.2])
def test_every_lock_lies_in_the_reported_range(
    status: GpuStatus, lo: int, hi: int, frac: float
) -> None:
    status = GpuStatus(
        **{**{f: getattr(status, f) for f in status.__slots__}, "priority": Priority.LOW}
    )
    p = PowerPolicy(row(["s1"]))
    r = p.tick(1.0, {"row-a": Reading(frac * 1000, 1.0), "s1": Reading(frac * 1000, 1.0)}, [status])
    locks = [d.command for d in r.decisions if isinstance(d.command, LockClocks)]
    assert locks, r.decisions
    for lock in locks:
        assert lo <= lock.min_mhz <= lock.max_mhz <= hi


def test_an_empty_clock_range_falls_back_to_power_limits_without_an_incident() -> None:
    bad = lp(
        sm_clock_min_mhz=1500, sm_clock_max_mhz=1000, power_limit_min_w=100, power_limit_max_w=400
    )
    p = PowerPolicy(row(["s1"]))
    r = p.tick(1.0, {"row-a": Reading(1200, 1.0), "s1": Reading(1200, 1.0)}, [bad])
    assert [type(d.command) for d in r.decisions] == [SetPowerLimit]
    cmd = r.decisions[0].command
    assert isinstance(cmd, SetPowerLimit) and cmd.limit_w == 100.0
    assert [i.kind for i in r.incidents] == ["brake"]


# ---------------------------------------------------------------------------- F3


def test_inverted_power_limit_bounds_are_treated_as_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inverted: dict[str, Any] = {"power_limit_min_w": 500.0, "power_limit_max_w": 400.0}
    p = PowerPolicy(row(["s1"], {"knob": "power_limit"}))
    with caplog.at_level(logging.WARNING, logger="power.policy"):
        r = p.tick(1.0, {"row-a": Reading(1200, 1.0), "s1": Reading(1200, 1.0)}, [lp(**inverted)])
        for t in range(2, 6):
            p.tick(float(t), {"row-a": Reading(1200, t), "s1": Reading(1200, t)}, [lp(**inverted)])
    assert not any(isinstance(d.command, SetPowerLimit) for d in r.decisions)
    assert [type(d.command) for d in r.decisions] == [LockClocks]  # the clocks still work
    assert "power-limit bounds inverted (min 500 W > max 400 W)" in r.decisions[0].reason
    assert sum("inverted" in m for m in caplog.messages) == 1
    # No clock range either: no knob, no command, rather than a limit above the maximum.
    q = PowerPolicy(row(["s1"]))
    odd = GpuStatus(server="s1", index=0, model="odd part", priority=Priority.LOW, **inverted)
    assert (
        q.tick(1.0, {"row-a": Reading(1200, 1.0), "s1": Reading(1200, 1.0)}, [odd]).decisions == []
    )


# ---------------------------------------------------------------------------- F4


@pytest.mark.parametrize("mhz", [1, 99, 5001, 99999])
def test_clock_overrides_out_of_sane_bounds_are_refused(mhz: int) -> None:
    with pytest.raises(ConfigError, match=r"clock_overrides_mhz\.a100\.brake: .*\[100, 5000\]"):
        row(["s1"], {"clock_overrides_mhz": {"a100": {"brake": mhz}}})


def test_clock_overrides_are_clamped_to_the_gpu_range() -> None:
    tree = row(["s1"], {"clock_overrides_mhz": {"a100": {"brake": 100, "lp_t1": 5000}}})
    profile = clock_profile(A100, overrides=tree.root.policy.clock_overrides_mhz)
    assert profile is not None
    assert profile.caps_mhz["brake"] == 210 and profile.caps_mhz["lp_t1"] == 1410
