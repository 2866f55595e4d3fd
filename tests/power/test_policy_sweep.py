"""Acceptance sweep, second pass: power situations the other policy tests leave out.

``test_power_sweep.py`` covers silent servers, caps that vanish or do not take, budgets
lowered below the draw, oscillation around T1 and absurd budgets. Each case here is another
situation a POLCA-style controller meets in production, driven through the pure policy's
public inputs (readings, GPU statuses as the agents report them, acks), with the outcome an
operator relies on stated in the test: no cap outside what the GPU can enforce, no flapping,
low priority first, a stale part never uncaps, every cap lifted once the load is gone.

Bugs it found (fixed; each test named ``..._bug`` failed before its fix):

* a NaN reading made its row NaN, which compares false with every threshold: the row was
  "complete" and never capped; a negative one undercounted the row (``power/domains.py``);
* a power limit outside the GPU's enforceable range: a table minimum above a reported
  maximum was sent as is, and rounding to 0.1 W could step below a reported minimum
  (``power/knobs.py``);
* a domain preferring power limits did not cap at all (not even the brake) a GPU whose
  limits are unknown but whose clocks are usable (``power/policy.py``);
* a lock that took at T1 on a GPU whose next clock command failed stayed on it for good:
  the failed knob was never used again, not even to release (``power/policy.py``);
* an adopted cap (restart, tree replaced, server moved to another rack) was loosened at
  the first tick (a T2 lock to T1's), though the rule is that it is kept one hold time
  (``power/policy.py``);
* a tree built in code (the simulator builds its own) was not checked: a cycle recursed
  forever, a duplicate name hid a domain, and a child whose ``parent`` was not set left
  the node's caps off its GPUs (``power/domains.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import yaml

from power.config import Knob, Level, PolicyConfig, Priority
from power.domains import Domain, DomainKind, DomainTree, Reading, parse_domains
from power.errors import ConfigError
from power.policy import Decision, GpuStatus, PowerPolicy
from power.reports import apply_job_priorities
from tests.power.power_sim import HOLD_S, Agents, row
from trainguard.wire import (
    LockClocks,
    SetPowerLimit,
    UnlockClocks,
)

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
LOW, HIGH = Priority.LOW, Priority.HIGH
LIMITS: dict[str, Any] = {
    "power_limit_min_w": 100.0,
    "power_limit_max_w": 400.0,
    "power_limit_w": 400.0,
}


def racks(placement: dict[str, Sequence[str]], *, row_w: float = 2000.0) -> DomainTree:
    """A row over racks of 1000 W each; ``placement`` maps rack -> its servers."""
    return parse_domains(
        {
            "name": "row-a",
            "kind": "row",
            "budget_w": row_w,
            "policy": {"min_hold_s": HOLD_S},
            "children": [
                {
                    "name": rack,
                    "kind": "rack",
                    "budget_w": 1000,
                    "children": [{"name": s, "kind": "server", "budget_w": 5000} for s in ss],
                }
                for rack, ss in placement.items()
            ],
        }
    )


def gpu(server: str, priority: Priority = LOW, index: int = 0, **kw: Any) -> GpuStatus:
    return GpuStatus(
        server=server, index=index, model=kw.pop("model", A100), priority=priority, **kw
    )


def watts(now: float, **per_server: float) -> dict[str, Reading]:
    return {s: Reading(w, now) for s, w in per_server.items()}


def even(
    frac: float, now: float, servers: Iterable[str] = ("s1", "s2", "s3")
) -> dict[str, Reading]:
    names = list(servers)
    return {s: Reading(frac * 1000.0 / len(names), now) for s in names}


def locks(decisions: Iterable[Decision]) -> dict[str, int]:
    return {d.node: d.command.max_mhz for d in decisions if isinstance(d.command, LockClocks)}


# ------------------------------------------------------------- (1, 2) enforceable limits


def test_an_infeasible_budget_on_power_limits_brakes_at_the_minimum_and_no_lower() -> None:
    """A budget lowered at run time under what every GPU at its minimum limit draws: the row
    brakes (one critical incident, the alert), each GPU gets exactly its minimum limit, and
    nothing is re-sent or lifted while it stays infeasible."""
    tree = row(budget_w=100, policy={"knob": "power_limit"})
    gpus = [gpu("s1", **LIMITS), gpu("s2", HIGH, **{**LIMITS, "power_limit_min_w": 150.0})]
    agents = Agents(PowerPolicy(tree), gpus)
    incidents = []
    for t in range(300):
        incidents += agents.tick(float(t), watts(float(t), s1=120, s2=160, s3=0)).incidents
    assert agents.policy.level("row-a") is Level.BRAKE
    assert [i.kind for i in incidents] == ["brake"]
    limits = {
        d.node: d.command.limit_w for d in agents.sent if isinstance(d.command, SetPowerLimit)
    }
    assert limits == {"s1": 100.0, "s2": 150.0}
    assert len(agents.sent) == 2


@pytest.mark.parametrize(
    ("reported", "brake_w"),
    [
        # A low-power part of a known family: the table's 100 W minimum is above its maximum.
        ({"power_limit_max_w": 90.0}, 90.0),
        # A minimum that 0.1 W rounding would step under (NVML reports milliwatts).
        ({"power_limit_min_w": 100.04, "power_limit_max_w": 400.0}, 100.04),
        ({"power_limit_min_w": 100.0, "power_limit_max_w": 400.0}, 100.0),
    ],
    ids=["table-min-above-reported-max", "min-not-on-0.1W", "plain"],
)
def test_power_limits_stay_within_the_gpus_enforceable_range_bug(
    reported: dict[str, Any], brake_w: float
) -> None:
    """BUG (fixed): NVML refuses a limit outside [min, max], so a limit out of range is a
    failed command and an uncapped GPU; every limit sent, brake and T1, lies inside it."""
    lo = reported.get("power_limit_min_w", 0.0)
    hi = reported["power_limit_max_w"]
    for frac, want_brake in ((1.2, True), (0.85, False)):
        policy = PowerPolicy(row(policy={"knob": "power_limit"}))
        (d,) = policy.tick(0.0, even(frac, 0.0), [gpu("s1", **reported)]).decisions
        assert isinstance(d.command, SetPowerLimit)
        assert lo <= d.command.limit_w <= hi
        if want_brake:
            assert d.command.limit_w == brake_w


def test_a_gpu_without_known_limits_is_capped_by_clocks_where_limits_are_preferred_bug() -> None:
    """BUG (fixed): a domain that prefers power limits, a GPU whose limits are unknown (a
    model not in the table, no bounds reported) but whose clock range is: it was not capped
    at all, not even by the brake, and nothing said so. Clocks cap it now, with the reason;
    a GPU reporting inverted bounds (min > max) is capped by clocks too."""
    unknown = gpu("s1", model="Mystery GPU", sm_clock_max_mhz=1500)
    inverted = gpu("s2", HIGH, power_limit_min_w=500.0, power_limit_max_w=400.0)
    policy = PowerPolicy(row(policy={"knob": "power_limit"}))
    result = policy.tick(0.0, even(1.2, 0.0), [unknown, inverted])
    assert policy.level("row-a") is Level.BRAKE
    by_node = {d.node: d for d in result.decisions}
    assert sorted(by_node) == ["s1", "s2"]
    assert all(isinstance(d.command, LockClocks) for d in by_node.values())
    assert by_node["s1"].knob is Knob.CLOCKS
    assert "clocks used: power limits unknown" in by_node["s1"].reason
    assert "power-limit bounds inverted" in by_node["s2"].reason


# ------------------------------------------------------------- (3) hysteresis around T2


def test_draw_hovering_around_t2_escalates_once_and_does_not_flap() -> None:
    """88% / 91% every other second for ten minutes: low priority goes to its T2 cap, high
    priority to its cap once the row is still above T2 after escalate_after_s, and neither
    is loosened or re-sent (88% never goes under the 84% release line)."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", HIGH)])
    for t in range(600):
        agents.tick(float(t), even(0.91 if t % 2 == 0 else 0.88, float(t)))
    assert agents.policy.level("row-a") is Level.T2_HP
    assert agents.kinds() == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert (agents.clock("s1"), agents.clock("s2")) == (1110, 1305)


def test_a_brief_dip_between_spikes_does_not_release_a_cap() -> None:
    """A training step's dip to 40% for a second, every 15 s, at an otherwise 85% row: the
    dip is under the release line but the level must have been held min_hold_s *and* be
    under it at the tick it steps down, so a lift happens at most once per hold; the
    cap is back on within one tick when the draw returns."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", HIGH)])
    uncapped_s = 0
    for t in range(300):
        agents.tick(float(t), even(0.40 if t % 15 == 14 else 0.85, float(t)))
        uncapped_s += agents.clock("s1") is None
    times = [d.command.issued_unix_s for d in agents.sent if isinstance(d.command, UnlockClocks)]
    assert all(b - a >= HOLD_S for a, b in itertools.pairwise(times))
    assert uncapped_s <= len(times)  # each lift lasts one tick: the next spike re-caps


# ------------------------------------------------------------- (4) priorities


def test_low_priority_is_capped_first_and_released_last_high_priority_the_reverse() -> None:
    """Up: T1 caps the low-priority GPU only, T2 lowers it further, then high priority.
    Down: one level per hold, so high priority is freed first and low priority last."""
    agents = Agents(PowerPolicy(row(policy={"escalate_after_s": 5})), [gpu("s1"), gpu("s2", HIGH)])
    steps = [(range(0, 10), 0.85), (range(10, 20), 0.92), (range(20, 80), 0.50)]
    order: list[tuple[str, int | None]] = []
    for times, frac in steps:
        for t in times:
            for d in agents.tick(float(t), even(frac, float(t))).decisions:
                cmd = d.command
                order.append((d.node, cmd.max_mhz if isinstance(cmd, LockClocks) else None))
    assert order == [
        ("s1", 1275),  # T1: low priority only
        ("s1", 1110),  # T2: low priority lower
        ("s2", 1305),  # still above T2 after 5 s: high priority
        ("s2", None),  # down to T2_LP: high priority freed first
        ("s1", 1275),  # down to T1
        ("s1", None),  # down to NONE: low priority freed last
    ]
    assert agents.policy.level("row-a") is Level.NONE


def test_two_jobs_of_the_same_priority_get_the_same_cap_at_the_same_tick() -> None:
    """Two low-priority jobs (one on s1 GPU 0, one on s1 GPU 1 and s2), a high-priority job
    on s3: at T1 every low-priority GPU gets the same cap in the same tick, whatever job or
    server; the high-priority one none. A GPU of another model gets its own model's T1
    cap, the same position in its range (no job pays for another's GPU model)."""
    base = [
        gpu("s1", HIGH, 0),
        gpu("s1", HIGH, 1),
        gpu("s2", HIGH, 0, model=H100),
        gpu("s3", HIGH, 0),
    ]
    placed = apply_job_priorities(
        base, [("s1", 0, LOW), ("s1", 1, LOW), ("s2", None, LOW), ("s3", None, HIGH)]
    )
    policy = PowerPolicy(row())
    result = policy.tick(0.0, even(0.85, 0.0), placed)
    got = {
        (d.node, d.gpu_index): d.command.max_mhz
        for d in result.decisions
        if isinstance(d.command, LockClocks)
    }
    assert got == {("s1", 0): 1275, ("s1", 1): 1275, ("s2", 0): 1800}


# ------------------------------------------------------------- (5) stale parts


def test_a_server_with_one_gpu_domain_silent_holds_only_that_gpus_cap() -> None:
    """GPU domains under a metered server: the server's own reading is fresh and the row
    drops, but GPU 1's domain has no reading. GPU 0 is released after the hold; GPU 1 is
    never uncapped blindly, since its domain cannot say it is under its budget."""
    tree = parse_domains(
        {
            "name": "row-a",
            "kind": "row",
            "budget_w": 1000,
            "policy": {"min_hold_s": HOLD_S},
            "children": [
                {
                    "name": "s1",
                    "kind": "server",
                    "budget_w": 5000,
                    "children": [
                        {"name": f"s1-g{i}", "kind": "gpu", "budget_w": 400, "gpu_index": i}
                        for i in (0, 1)
                    ],
                }
            ],
        }
    )
    agents = Agents(PowerPolicy(tree), [gpu("s1", index=0), gpu("s1", index=1)])
    agents.tick(0.0, watts(0.0, s1=850, **{"s1-g0": 300, "s1-g1": 300}))
    assert (agents.clock("s1", 0), agents.clock("s1", 1)) == (1275, 1275)
    for t in range(1, 120):
        result = agents.tick(float(t), watts(float(t), s1=300, **{"s1-g0": 100}))
        assert result.domains["s1"].complete and not result.domains["s1-g1"].complete
    assert agents.policy.level("row-a") is Level.NONE
    assert (agents.clock("s1", 0), agents.clock("s1", 1)) == (None, 1275)


def test_a_row_whose_agents_all_went_silent_holds_every_cap() -> None:
    """Every agent silent (a network partition): the row's power is a lower bound of 0 W;
    it holds its level and every cap for as long as it lasts, and says so once."""
    agents = Agents(PowerPolicy(row(policy={"escalate_after_s": 5})), [gpu("s1"), gpu("s2", HIGH)])
    for t in range(10):
        agents.tick(float(t), even(0.92, float(t)))
    assert agents.policy.level("row-a") is Level.T2_HP
    sent = len(agents.sent)
    incidents = []
    for t in range(10, 1000):
        incidents += agents.tick(float(t), {}).incidents
    assert agents.policy.level("row-a") is Level.T2_HP
    assert len(agents.sent) == sent and (agents.clock("s1"), agents.clock("s2")) == (1110, 1305)
    assert [i.kind for i in incidents] == ["telemetry_stale"]


# ------------------------------------------------------------- (6) child vs parent


def test_a_rack_over_its_budget_caps_only_its_own_gpus() -> None:
    """rack-1 at 95% of its budget while the row is at 57%: rack-1's GPUs are capped (low
    priority first, then high), rack-2's are untouched, the row stays at NONE."""
    tree = racks({"rack-1": ["s1", "s2"], "rack-2": ["s3", "s4"]})
    gpus = [gpu("s1"), gpu("s2", HIGH), gpu("s3"), gpu("s4", HIGH)]
    agents = Agents(PowerPolicy(tree), gpus)
    for t in range(10):
        agents.tick(float(t), watts(float(t), s1=475, s2=475, s3=100, s4=100))
    assert agents.policy.level("row-a") is Level.NONE
    assert agents.policy.level("rack-1") is Level.T2_HP
    assert sorted(agents.kinds()) == [("s1", "lock_clocks"), ("s2", "lock_clocks")]
    assert {d.domain for d in agents.sent} == {"rack-1"}


def test_a_row_over_its_budget_caps_every_racks_low_priority_and_release_follows_levels() -> None:
    """The reverse: a metered row at 85% with both racks under T1 caps low priority in both
    racks. Then rack-1 also goes to T2: its low-priority GPU gets the lower cap (most
    restrictive wins), loosens back to the row's T1 cap when rack-1 drops, and every cap is
    lifted once the row drops too."""
    tree = racks({"rack-1": ["s1", "s2"], "rack-2": ["s3", "s4"]})
    gpus = [gpu("s1"), gpu("s2", HIGH), gpu("s3"), gpu("s4", HIGH)]
    agents = Agents(PowerPolicy(tree), gpus)

    def tick(t: int, s12: float, row_w: float) -> None:
        r = watts(float(t), s1=s12, s2=s12, s3=350, s4=350)
        r["row-a"] = Reading(row_w, float(t))
        agents.tick(float(t), r)

    tick(0, 350, 1700)
    assert locks(agents.sent) == {"s1": 1275, "s3": 1275}
    assert agents.policy.level("rack-1") is Level.NONE
    tick(1, 460, 1700)  # rack-1 at 92%
    assert agents.clock("s1") == 1110 and agents.clock("s3") == 1275
    for t in range(2, 30):
        tick(t, 300, 1700)  # rack-1 back to 60%: down one level per hold
    assert agents.policy.level("rack-1") is Level.NONE
    assert agents.policy.level("row-a") is Level.T1
    assert (agents.clock("s1"), agents.clock("s3")) == (1275, 1275)
    for t in range(30, 60):
        tick(t, 200, 1000)
    assert [g.locked_sm_clock_mhz for g in agents.gpus.values()] == [None] * 4


# ------------------------------------------------------------- (8) hostile values


@pytest.mark.parametrize("bad", [math.nan, -500.0], ids=["nan", "negative"])
def test_a_reading_that_is_not_watts_counts_as_missing_bug(bad: float) -> None:
    """BUG (fixed): the wire refuses such values, but the policy is also fed by the simulator
    and by code. A NaN server made the row NaN: complete, and under every threshold, so a
    row at 95% was never capped; a negative one undercounted the row (450 W here) into an
    uncap. Now the reading is missing: the row escalates on its fresh lower bound and holds."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", HIGH)])
    result = agents.tick(0.0, watts(0.0, s1=bad, s2=500, s3=450))
    seen = result.domains["row-a"]
    assert seen.power_w == 950.0 and not seen.complete
    assert agents.policy.level("row-a") is Level.T2_LP
    assert agents.kinds() == [("s1", "lock_clocks")]
    for t in range(1, 100):  # the bad server never lets the row uncap
        agents.tick(float(t), watts(float(t), s1=bad, s2=100, s3=100))
    assert agents.clock("s1") == 1110


def test_a_meter_reading_nan_makes_its_domain_incomplete() -> None:
    """A metered row whose meter reads NaN falls back to its servers' sum, as with a stale
    meter: good enough to escalate, never to uncap."""
    agents = Agents(PowerPolicy(row()), [gpu("s1")])
    r = watts(0.0, s1=300, s2=300, s3=300)
    r["row-a"] = Reading(math.nan, 0.0)
    result = agents.tick(0.0, r)
    assert result.domains["row-a"].power_w == 900.0
    assert not result.domains["row-a"].complete
    assert agents.policy.level("row-a") is Level.T2_LP


def _row_in_code(*servers: str, budget_w: float = 1000.0) -> Domain:
    row = Domain(name="row-a", kind=DomainKind.ROW, budget_w=budget_w, policy=PolicyConfig())
    for s in servers:
        row.children.append(
            Domain(name=s, kind=DomainKind.SERVER, budget_w=500, policy=row.policy, parent=row)
        )
    return row


def test_a_tree_built_in_code_is_checked_like_a_parsed_one_bug() -> None:
    """BUG (fixed): DomainTree took any Domain graph. A cycle recursed until the interpreter
    gave up, a duplicate name hid the second domain from the policy, a child whose parent
    was not set left the row's caps off its GPUs, a zero budget divided by zero on the
    first tick. Each is now one ConfigError line naming the path."""
    cyclic = _row_in_code("s1")
    cyclic.children[0].children.append(cyclic)
    orphan = _row_in_code("s1")
    orphan.children[0].parent = None
    cases: list[tuple[Domain, str]] = [
        (cyclic, r"^domains\.children\[0\]\.children\[0\]: domain 'row-a' appears twice"),
        (_row_in_code("s1", "s1"), r"^domains\.children\[1\]\.name: duplicate domain name 's1'"),
        (orphan, r"^domains\.children\[0\]\.parent: must be 'row-a', got None"),
        (_row_in_code("s1", budget_w=0.0), r"^domains\.budget_w: must be a positive number"),
        (_row_in_code("s1", budget_w=math.nan), r"^domains\.budget_w: must be a positive"),
    ]
    for root, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            DomainTree(root)
        assert "\n" not in str(err.value)
    # A well-formed tree in code still works, in the same order as before.
    tree = DomainTree(_row_in_code("s1", "s2"))
    assert list(tree.by_name) == ["row-a", "s1", "s2"]


def test_a_self_referencing_yaml_tree_is_refused_with_one_line() -> None:
    """A YAML anchor that contains itself is a cyclic document; parsing stops at the
    repeated name instead of recursing."""
    doc = yaml.safe_load("r: &r {name: row-a, kind: row, budget_w: 100, children: [*r]}")["r"]
    with pytest.raises(ConfigError, match=r"duplicate domain name 'row-a'"):
        parse_domains(doc)


# ------------------------------------------------------------- (9) a GPU changing domains


def test_a_server_moved_to_a_calm_rack_keeps_its_cap_one_hold_then_loses_it() -> None:
    """s1 is capped at T2 by rack-1; the tree is replaced with s1 under rack-2, which is
    calm. The new policy adopts the lock and lifts it only after min_hold_s."""
    old = Agents(
        PowerPolicy(racks({"rack-1": ["s1", "s2"], "rack-2": ["s3"]})),
        [gpu("s1"), gpu("s2", HIGH), gpu("s3")],
    )
    old.tick(0.0, watts(0.0, s1=475, s2=475, s3=100))
    assert old.clock("s1") == 1110
    tree = racks({"rack-1": ["s2"], "rack-2": ["s1", "s3"]})
    new = Agents(PowerPolicy(tree, ours=old.policy.ours()), list(old.gpus.values()))
    for t in range(1, 30):
        new.tick(float(t), watts(float(t), s1=300, s2=300, s3=100))
        if t < 1 + HOLD_S:
            assert new.clock("s1") == 1110
    assert new.kinds() == [("s1", "unlock_clocks")]
    assert new.sent[0].command.issued_unix_s == 1 + HOLD_S


def test_an_adopted_cap_is_not_loosened_before_its_hold_bug() -> None:
    """BUG (fixed): s1 (locked at 1110 by T2 under the old tree) moves to a rack now at 86%
    (T1): the new policy loosened it to 1275 at its first tick, letting back up the draw
    that lock was holding down, where an adopted cap is kept one hold time. It is kept, and
    loosened once the hold is over; a tighter cap is never delayed."""
    gpus = [gpu("s1", locked_sm_clock_mhz=1110), gpu("s3"), gpu("s4", HIGH)]
    agents = Agents(PowerPolicy(racks({"rack-2": ["s1", "s3", "s4"]})), gpus)
    for t in range(0, 30):
        agents.tick(float(t), watts(float(t), s1=400, s3=300, s4=160))
        if t < HOLD_S:
            assert agents.clock("s1") == 1110
            assert agents.clock("s3") == 1275  # the fresh GPU is capped at once
    assert agents.policy.level("rack-2") is Level.T1
    assert agents.clock("s1") == 1275
    loosened = [d for d in agents.sent if d.node == "s1"]
    assert [d.command.issued_unix_s for d in loosened] == [HOLD_S]


def test_a_node_relabelled_to_high_priority_while_capped_at_t1_is_released() -> None:
    """At T1 only low priority is capped: a node re-labelled high (or its job raised) gets
    its lock lifted at the next tick, and capped again if it goes back to low."""
    agents = Agents(PowerPolicy(row()), [gpu("s1"), gpu("s2", HIGH)])
    agents.tick(0.0, even(0.85, 0.0))
    key = ("s1", 0)
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], priority=HIGH)
    agents.tick(1.0, even(0.85, 1.0))
    assert agents.clock("s1") is None
    agents.gpus[key] = dataclasses.replace(agents.gpus[key], priority=LOW)
    agents.tick(2.0, even(0.85, 2.0))
    assert agents.kinds() == [("s1", "lock_clocks"), ("s1", "unlock_clocks"), ("s1", "lock_clocks")]


# ------------------------------------------------------------- (10) every cap lifted


def test_a_lock_left_by_a_knob_that_later_failed_is_lifted_at_the_end_bug() -> None:
    """BUG (fixed): s1 is locked at T1 (1275 MHz); at T2 its next lock fails (Insufficient
    Permissions), so the power limit takes over. When the load drops the limit was reset
    but the T1 lock, set by a knob no longer used, stayed on the GPU for good. It is
    released with the rest; a release that fails too is not retried in a loop."""
    agents = Agents(PowerPolicy(row()), [gpu("s1", **LIMITS), gpu("s2", HIGH, **LIMITS)])
    agents.tick(0.0, even(0.85, 0.0))
    agents.tick(1.0, even(0.85, 1.0))
    assert agents.clock("s1") == 1275
    agents.fail = {"lock_clocks"}
    for t in range(2, 5):
        agents.tick(float(t), even(0.92, float(t)))
    assert agents.kinds() == [
        ("s1", "lock_clocks"),
        ("s1", "lock_clocks"),
        ("s1", "set_power_limit"),
    ]
    for t in range(5, 100):
        agents.tick(float(t), even(0.3, float(t)))
    assert agents.policy.level("row-a") is Level.NONE
    g = agents.gpus[("s1", 0)]
    assert g.locked_sm_clock_mhz is None and g.power_limit_w == 400.0
    assert agents.kinds(3) == [
        ("s1", "set_power_limit"),  # T2_LP -> T1: the T1 limit
        ("s1", "unlock_clocks"),  # T1 -> NONE: both knobs released
        ("s1", "reset_power_limit"),
    ]


def test_a_release_that_fails_is_tried_once_not_every_tick() -> None:
    """As above, but the unlock fails too: one attempt, one incident, then quiet; the lock
    stays (an operator must unlock it) and the power limit is still reset."""
    agents = Agents(PowerPolicy(row()), [gpu("s1", **LIMITS)])
    agents.tick(0.0, even(0.85, 0.0))
    agents.tick(1.0, even(0.85, 1.0))
    agents.fail = {"lock_clocks", "unlock_clocks"}
    for t in range(2, 5):
        agents.tick(float(t), even(0.92, float(t)))
    incidents = []
    for t in range(5, 200):
        incidents += agents.tick(float(t), even(0.3, float(t))).incidents
    assert agents.kinds(3).count(("s1", "unlock_clocks")) == 1
    assert [i.kind for i in incidents] == ["clock_command_failed"]
    # Said as what it is: not "escalating to the power-limit knob" (there is no cap to move)
    assert incidents[0].message == (
        "s1 GPU 0: clock unlock failed (Insufficient Permissions); the lock stays until an "
        "operator resets the clocks (not tried again)"
    )
    g = agents.gpus[("s1", 0)]
    assert g.locked_sm_clock_mhz == 1275 and g.power_limit_w == 400.0


def test_every_cap_is_lifted_once_a_braked_mixed_row_goes_quiet() -> None:
    """Brake with clocks on one GPU and power limits on another (its clocks failed): once
    the row is quiet every cap is lifted, one level per hold (BRAKE, T2_HP, T2_LP, T1, so
    four holds), and nothing is sent afterwards."""
    agents = Agents(
        PowerPolicy(row(policy={"escalate_after_s": 2})),
        [gpu("s1", **LIMITS), gpu("s2", HIGH, **LIMITS), gpu("s3", **LIMITS)],
    )
    agents.fail = {"lock_clocks"}
    agents.tick(0.0, even(1.1, 0.0))  # s1 and s3 fail to lock, s2 too
    agents.fail = set()
    for t in range(1, 5):
        agents.tick(float(t), even(1.1, float(t)))
    assert agents.policy.level("row-a") is Level.BRAKE
    levels = []
    for t in range(5, 5 + 5 * int(HOLD_S)):
        agents.tick(float(t), even(0.2, float(t)))
        levels.append(agents.policy.level("row-a"))
    assert levels[-1] is Level.NONE
    assert [lvl for lvl, _ in itertools.groupby(levels)] == [
        Level.BRAKE,
        Level.T2_HP,
        Level.T2_LP,
        Level.T1,
        Level.NONE,
    ]
    for g in agents.gpus.values():
        assert g.locked_sm_clock_mhz is None and g.power_limit_w == 400.0
    quiet = len(agents.sent)
    for t in range(100, 400):
        agents.tick(float(t), even(0.2, float(t)))
    assert len(agents.sent) == quiet


def test_a_gpu_that_must_be_capped_and_has_no_knob_is_said_once() -> None:
    """A model not in the table that reports neither clocks nor limits cannot be capped. It
    used to draw uncapped with no incident at all: only a note on a decision never sent."""
    unknown = gpu("s1", model="Acme Tensor 9000")
    agents = Agents(PowerPolicy(row()), [unknown, gpu("s2")])
    said = []
    for t in range(5):  # the row stays over T1: the GPU stays uncappable
        said += [i for i in agents.tick(float(t), even(0.93, float(t))).incidents]
    assert [(i.kind, i.node, i.gpu_index, i.domain) for i in said] == [
        ("gpu_uncappable", "s1", 0, "row-a")
    ]
    assert "cannot be capped (no usable knob: power limits unknown)" in said[0].message
    assert ("s2", "lock_clocks") in agents.kinds()  # the others take its share


def test_every_policy_incident_kind_becomes_a_controller_incident() -> None:
    """A policy incident kind the controller's loop cannot map would raise in the loop."""
    from typing import get_args

    from controller.services.power.loop import INCIDENT_KINDS
    from power.tick_io import PolicyIncidentKind

    assert set(get_args(PolicyIncidentKind)) == set(INCIDENT_KINDS)
