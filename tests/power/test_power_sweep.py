"""Acceptance sweep: the power policy against what a real datacenter feeds it.

The policy tests check the state machine on tidy readings. Here each case is a telemetry
gap, a misbehaving node, a cluster change or an absurd number that production produces,
driven through the same inputs the controller gives the policy (wire samples turned into
readings, GPU statuses as the agents report them, acks), and each test states the
operator-facing outcome: the budget is not silently exceeded, caps do not flap, nothing
crashes, no node is silently ignored.

Two bugs it found (fixed, see ``power/reports.py`` and ``power/policy.py``):

* a node with a RAPL meter and one GPU not answering (NOT_SUPPORTED, lost) gave a server
  reading of RAPL plus the GPUs that answered, a partial sum trusted as complete: the
  domain could uncap or run over budget on an undercount;
* a cap that vanished under the policy (the agent restarted and forgot its lock, a GPU reset
  put the limit back at the maximum, someone unlocked it by hand) was never sent again: the
  policy believed the old ack for as long as its domain stayed at the same level.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any

import pytest
from pydantic import ValidationError

from power.config import Level, Priority
from power.domains import Reading, parse_domains
from power.errors import ConfigError
from power.policy import GpuStatus, PowerPolicy
from power.reports import readings_from_sample
from tests.power.power_sim import BUDGET, HOLD_S, Agents, row
from trainguard.wire import (
    GpuSample,
    NodeSample,
    UnlockClocks,
)

A100 = "NVIDIA A100-SXM4-80GB"


def gpu(server: str, priority: Priority = Priority.LOW, **kw: Any) -> GpuStatus:
    return GpuStatus(server=server, index=0, model=A100, priority=priority, **kw)


def even(
    frac: float, now: float, servers: Iterable[str] = ("s1", "s2", "s3")
) -> dict[str, Reading]:
    names = list(servers)
    return {s: Reading(frac * BUDGET / len(names), now) for s in names}


# ----------------------------------------------------------------------- telemetry gaps


def test_a_server_that_stops_reporting_is_not_taken_as_zero_watts() -> None:
    """Row at 85%: the low-priority server is capped. Then s3 goes silent (its last reading
    ages out after 10 s) and the two that still report fall to 40%: the row is incomplete,
    so it holds T1 however long, where a missing 0 W would have lifted the cap."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    agents.tick(0.0, even(0.85, 0.0))
    assert agents.kinds() == [("s1", "lock_clocks")]
    stale_incidents = 0
    for t in range(1, 200):
        now = float(t)
        each = 283.0 if now <= 10 else 200.0
        readings = {"s1": Reading(each, now), "s2": Reading(each, now), "s3": Reading(283, 0.0)}
        result = agents.tick(now, readings)
        stale_incidents += sum(i.kind == "telemetry_stale" for i in result.incidents)
        assert result.domains["row-a"].complete is (now <= 10)
    assert agents.policy.level("row-a") is Level.T1
    assert agents.kinds() == [("s1", "lock_clocks")]  # never uncapped
    assert stale_incidents == 1  # one incident, not one per tick


def test_a_silent_server_still_lets_the_fresh_ones_escalate() -> None:
    """The fresh part is a lower bound: enough on its own to brake the row."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    result = agents.tick(100.0, {"s1": Reading(600, 100.0), "s2": Reading(450, 100.0)})
    assert result.domains["row-a"].complete is False
    assert agents.policy.level("row-a") is Level.BRAKE
    assert sorted(agents.kinds()) == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert [i.kind for i in result.incidents].count("brake") == 1


@pytest.mark.parametrize(
    "silent",
    [
        GpuSample(index=1, power_w=None),  # NVML_ERROR_NOT_SUPPORTED / no answer
        GpuSample(index=1, power_w=350.0, lost=True),  # off the bus
    ],
    ids=["not-supported", "lost"],
)
def test_a_rapl_node_with_a_silent_gpu_gives_no_reading_and_caps_hold(silent: GpuSample) -> None:
    """BUG (fixed): the agent's RAPL figure is RAPL plus the GPUs that answered, so it is a
    partial sum; it used to be trusted as the server's reading."""
    sample = NodeSample(
        time_unix_s=50.0,
        gpus=[GpuSample(index=0, power_w=300.0), silent],
        node_power_w=300.0 + 150.0,  # GPU 0 + CPU/DRAM; GPU 1 is missing from it
        node_power_source="rapl",
    )
    assert readings_from_sample("s1", sample, time_s=50.0) == {}
    # Every GPU answered: the RAPL figure is the server's reading again.
    whole = sample.model_copy(update={"gpus": [sample.gpus[0], GpuSample(index=1, power_w=10.0)]})
    assert readings_from_sample("s1", whole, time_s=50.0)["s1"].power_w == 450.0

    # Operator-facing: a row capped at T1 does not uncap on the undercount.
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    agents.tick(0.0, even(0.85, 0.0))
    for t in range(1, 60):
        now = float(t)
        readings = {"s2": Reading(100, now), "s3": Reading(100, now)}
        readings.update(readings_from_sample("s1", sample, time_s=now))
        agents.tick(now, readings)
    assert agents.policy.level("row-a") is Level.T1
    assert agents.kinds() == [("s1", "lock_clocks")]


def test_a_gpu_sum_node_with_a_silent_gpu_gives_no_reading() -> None:
    sample = NodeSample(
        time_unix_s=1.0,
        gpus=[GpuSample(index=0, power_w=300.0), GpuSample(index=1, power_w=None)],
        node_power_w=300.0,
        node_power_source="gpu_sum",
    )
    assert readings_from_sample("s1", sample) == {}


def test_a_zero_watt_reading_is_a_reading() -> None:
    """An idle (or switched-off) server at 0 W is fresh and complete: the row may uncap."""
    sample = NodeSample(time_unix_s=1.0, gpus=[GpuSample(index=0, power_w=0.0)])
    assert readings_from_sample("s3", sample)["s3"].power_w == 0.0
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    agents.tick(0.0, even(0.85, 0.0))
    for t in range(1, 30):
        now = float(t)
        readings = {"s1": Reading(200, now), "s2": Reading(200, now)}
        readings.update(readings_from_sample("s3", sample, time_s=now))
        agents.tick(now, readings)
    assert agents.policy.level("row-a") is Level.NONE
    assert agents.kinds() == [("s1", "lock_clocks"), ("s1", "unlock_clocks")]


def test_negative_nan_and_infinite_telemetry_never_reach_the_policy() -> None:
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValidationError):
            GpuSample(index=0, power_w=bad)
        with pytest.raises(ValidationError):
            NodeSample(time_unix_s=1.0, node_power_w=bad, node_power_source="rapl")


# ----------------------------------------------------------------------- caps that do not take


def test_a_cap_that_vanishes_is_sent_again() -> None:
    """BUG (fixed): the agent restarts (its lock record is gone) or someone unlocks the GPU
    while the row is still at T1: the report shows no lock, the policy re-sends it instead
    of believing the old ack."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    agents.tick(0.0, even(0.85, 0.0))
    for t in range(1, 5):
        agents.tick(float(t), even(0.85, float(t)))
    assert agents.kinds() == [("s1", "lock_clocks")]  # steady: nothing re-sent
    key = ("s1", 0)
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], locked_sm_clock_mhz=None)
    agents.tick(5.0, even(0.85, 5.0))
    assert agents.kinds(1) == [("s1", "lock_clocks")]
    assert agents.gpus[key].locked_sm_clock_mhz == 1275
    for t in range(6, 30):
        agents.tick(float(t), even(0.85, float(t)))
    assert len(agents.sent) == 2  # and then quiet again


def test_a_power_limit_reset_under_the_policy_is_set_again() -> None:
    """A GPU reset puts the power limit back at the maximum; the row still needs the cap."""
    limits: dict[str, Any] = {
        "power_limit_min_w": 100.0,
        "power_limit_max_w": 400.0,
        "power_limit_w": 400.0,
    }
    policy = PowerPolicy(row(policy={"knob": "power_limit"}))
    agents = Agents(policy, [gpu("s1", **limits), gpu("s2", Priority.HIGH, **limits)])
    agents.tick(0.0, even(0.85, 0.0))
    agents.tick(1.0, even(0.85, 1.0))
    assert agents.kinds() == [("s1", "set_power_limit")]
    key = ("s1", 0)
    capped = agents.gpus[key].power_limit_w
    # The driver did not answer for the limit once: not taken as "no limit".
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], power_limit_w=None)
    agents.tick(2.0, even(0.85, 2.0))
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], power_limit_w=capped)
    agents.tick(3.0, even(0.85, 3.0))
    assert len(agents.sent) == 1
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], power_limit_w=400.0)
    agents.tick(4.0, even(0.85, 4.0))
    assert agents.kinds(1) == [("s1", "set_power_limit")]
    assert agents.gpus[key].power_limit_w == capped


def test_a_cap_acked_but_ignored_escalates_instead_of_being_trusted() -> None:
    """s1 acks its cap but its draw does not move: the row keeps climbing through T2 to the
    high-priority cap and the brake, and the level change is recorded as not observed."""
    policy = PowerPolicy(row(policy={"escalate_after_s": 5}))
    agents = Agents(policy, [gpu("s1"), gpu("s2", Priority.HIGH)])
    agents.ignore = {"s1", "s2"}
    agents.tick(0.0, even(0.85, 0.0))
    assert policy.level("row-a") is Level.T1
    agents.tick(1.0, even(0.92, 1.0))
    assert policy.level("row-a") is Level.T2_LP
    for t in range(2, 8):
        agents.tick(float(t), even(0.92, float(t)))
    assert policy.level("row-a") is Level.T2_HP
    assert ("s2", "lock_clocks") in agents.kinds()
    result = agents.tick(8.0, even(1.02, 8.0))
    assert policy.level("row-a") is Level.BRAKE
    assert [i.kind for i in result.incidents] == ["brake"]
    effects = []
    for t in range(9, 140):
        effects += agents.tick(float(t), even(1.02, float(t))).effects
    assert [(e.to_level, e.observed) for e in effects] == [(Level.BRAKE, False)]


# ----------------------------------------------------------------------- cluster changes


def test_a_budget_lowered_below_the_draw_brakes_at_once() -> None:
    """The tree is replaced with a smaller budget (PUT /power/domains): the new policy
    adopts the T1 cap in force and brakes on its first tick, without waiting a hold."""
    old = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    old.tick(0.0, even(0.85, 0.0))
    old.tick(1.0, even(0.85, 1.0))
    new = Agents(PowerPolicy(row(budget_w=600), ours=old.policy.ours()), list(old.gpus.values()))
    result = new.tick(2.0, even(0.85, 2.0))  # 850 W of a 600 W budget
    assert new.policy.level("row-a") is Level.BRAKE
    assert sorted(new.kinds()) == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert {d.command.max_mhz for d in result.decisions} == {210}  # type: ignore[union-attr]


def test_an_infeasible_budget_holds_the_brake_without_flapping() -> None:
    """A budget under what the servers draw even at the lowest clock: the row stays in the
    brake, each GPU gets one command, one incident, and nothing is lifted or re-sent."""
    agents = Agents(PowerPolicy(row(budget_w=100)), [gpu("s1"), gpu("s2", Priority.HIGH)])
    incidents = []
    for t in range(0, 300):
        now = float(t)
        incidents += agents.tick(now, {s: Reading(60, now) for s in ("s1", "s2", "s3")}).incidents
    assert agents.policy.level("row-a") is Level.BRAKE
    assert sorted(agents.kinds()) == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert [i.kind for i in incidents] == ["brake"]


def test_all_high_priority_is_left_alone_until_t2_then_capped() -> None:
    gpus = [gpu(s, Priority.HIGH) for s in ("s1", "s2", "s3")]
    agents = Agents(PowerPolicy(row(policy={"escalate_after_s": 5})), gpus)
    for t in range(0, 30):
        agents.tick(float(t), even(0.85, float(t)))
    assert agents.sent == []  # T1 caps low priority only; there is none
    for t in range(30, 40):
        agents.tick(float(t), even(0.92, float(t)))
    assert agents.policy.level("row-a") is Level.T2_HP
    assert sorted(agents.kinds()) == [(s, "lock_clocks") for s in ("s1", "s2", "s3")]
    assert {d.command.max_mhz for d in agents.sent} == {1305}  # type: ignore[union-attr]


def test_all_low_priority_is_capped_together_at_t1() -> None:
    agents = Agents(PowerPolicy(row()), [gpu(s) for s in ("s1", "s2", "s3")])
    agents.tick(0.0, even(0.85, 0.0))
    assert sorted(agents.kinds()) == [(s, "lock_clocks") for s in ("s1", "s2", "s3")]


def test_a_server_joining_a_capped_row_gets_the_row_cap() -> None:
    """A server in the tree whose agent starts while the row is at T1 is capped at once."""
    agents = Agents(PowerPolicy(row()), [gpu("s1")])
    agents.tick(0.0, even(0.85, 0.0))
    agents.gpus[("s3", 0)] = gpu("s3")
    agents.tick(1.0, even(0.85, 1.0))
    assert agents.kinds() == [("s1", "lock_clocks"), ("s3", "lock_clocks")]


def test_the_same_server_under_two_racks_is_refused_at_load() -> None:
    def rack(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "kind": "rack",
            "budget_w": 500,
            "children": [{"name": "s1", "kind": "server", "budget_w": 400}],
        }

    with pytest.raises(ConfigError, match=r"duplicate domain name 's1'") as err:
        parse_domains(
            {"name": "row-a", "kind": "row", "budget_w": 900, "children": [rack("r1"), rack("r2")]}
        )
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------- oscillation


def test_draw_hovering_around_t1_does_not_flap_caps() -> None:
    """78% / 81% every other second for ten minutes: one cap, never lifted (78% is above the
    75% release line)."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    for t in range(600):
        agents.tick(float(t), even(0.81 if t % 2 else 0.78, float(t)))
    assert agents.kinds() == [("s1", "lock_clocks")]


def test_draw_swinging_across_the_release_line_changes_caps_at_most_once_per_hold() -> None:
    """74% / 81%: the cap is lifted and set again, but never twice within min_hold_s."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    for t in range(300):
        agents.tick(float(t), even(0.81 if t % 2 else 0.74, float(t)))
    times = [d.command.issued_unix_s for d in agents.sent if isinstance(d.command, UnlockClocks)]
    assert times and all(b - a >= HOLD_S for a, b in itertools.pairwise(times))
    assert len(agents.sent) <= 2 * (300 / HOLD_S) + 1


# ----------------------------------------------------------------------- absurd numbers


def test_a_budget_of_1e308_loads_and_caps_nothing() -> None:
    agents = Agents(PowerPolicy(row(budget_w=1e308)), [gpu("s1")])
    result = agents.tick(0.0, even(0.85, 0.0))
    assert result.domains["row-a"].level is Level.NONE and agents.sent == []


@pytest.mark.parametrize("budget", [math.inf, math.nan, -5, 0, True, "1000"])
def test_budgets_that_are_not_watts_are_refused(budget: object) -> None:
    with pytest.raises(ConfigError, match=r"domains\.budget_w: must be a positive number"):
        parse_domains({"name": "row-a", "kind": "row", "budget_w": budget})


def test_readings_at_the_wire_maximum_brake_without_crashing() -> None:
    """The wire lets any finite watts through (the agent itself drops NVML's sentinels above
    10 kW); two servers at 1e308 W sum to infinity: the row brakes, nothing raises."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", Priority.HIGH)])
    big = {"s1": Reading(1e308, 0.0), "s2": Reading(1e308, 0.0), "s3": Reading(0, 0.0)}
    result = agents.tick(0.0, big)
    assert agents.policy.level("row-a") is Level.BRAKE
    assert sorted(agents.kinds()) == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert result.domains["row-a"].power_w == math.inf
