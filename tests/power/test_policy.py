"""The POLCA state machine: thresholds, escalation order, hysteresis, hold, safety rules."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from power.config import Knob, Level, PolicyConfig, Priority
from power.domains import Reading, parse_domains
from power.policy import Decision, GpuStatus, PowerPolicy, TickResult
from trainguard.wire import (
    CommandAck,
    CommandStatus,
    LockClocks,
    ResetPowerLimit,
    SetPowerLimit,
    UnlockClocks,
)

BUDGET = 1000.0
LP = GpuStatus(server="s-lp", index=0, model="NVIDIA A100-SXM4-80GB", priority=Priority.LOW)
HP = GpuStatus(server="s-hp", index=0, model="NVIDIA A100-SXM4-80GB", priority=Priority.HIGH)


def tree(policy: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    raw: dict[str, object] = {
        "name": "row-a",
        "kind": "row",
        "budget_w": BUDGET,
        "children": [
            {"name": "s-lp", "kind": "server", "budget_w": 900},
            {"name": "s-hp", "kind": "server", "budget_w": 900},
        ],
    }
    if policy:
        raw["policy"] = policy
    return parse_domains(raw)


def readings(frac: float, now: float) -> dict[str, Reading]:
    """A metered row at ``frac`` of its budget, split evenly over the two servers."""
    half = frac * BUDGET / 2
    return {
        "row-a": Reading(frac * BUDGET, now),
        "s-lp": Reading(half, now),
        "s-hp": Reading(half, now),
    }


class Loop:
    """Drives a policy like the controller would, acknowledging commands as the agent."""

    def __init__(self, policy: PowerPolicy, gpus: Sequence[GpuStatus] = (LP, HP)) -> None:
        self.policy = policy
        self.gpus = list(gpus)
        self.acks: list[CommandAck] = []
        self.clock: dict[tuple[str, int], int | None] = {}
        self.limit: dict[tuple[str, int], float | None] = {}
        self.fail_kinds: set[str] = set()

    def tick(self, now: float, frac: float | None) -> TickResult:
        r = readings(frac, now) if frac is not None else {}
        result = self.policy.tick(now, r, self.gpus, self.acks)
        self.acks = []
        for d in result.decisions:
            self._execute(d, now)
        return result

    def _execute(self, d: Decision, now: float) -> None:
        cmd = d.command
        key = (d.node, d.gpu_index)
        if cmd.kind in self.fail_kinds:
            status, reason = CommandStatus.FAILED, "Insufficient Permissions"
        else:
            status, reason = CommandStatus.SUCCEEDED, ""
            if isinstance(cmd, LockClocks):
                self.clock[key] = cmd.max_mhz
            elif isinstance(cmd, UnlockClocks):
                self.clock[key] = None
            elif isinstance(cmd, SetPowerLimit):
                self.limit[key] = cmd.limit_w
            elif isinstance(cmd, ResetPowerLimit):
                self.limit[key] = None
        self.acks.append(
            CommandAck(command_id=cmd.id, status=status, reason=reason, finished_unix_s=now)
        )

    def lp(self) -> int | None:
        return self.clock.get(("s-lp", 0))

    def hp(self) -> int | None:
        return self.clock.get(("s-hp", 0))


def test_below_t1_nothing_happens() -> None:
    loop = Loop(PowerPolicy(tree()))
    for t in range(10):
        assert loop.tick(float(t), 0.79).decisions == []
    assert loop.policy.level("row-a") is Level.NONE


def test_t1_caps_only_low_priority_at_moderate_clock() -> None:
    loop = Loop(PowerPolicy(tree()))
    res = loop.tick(0.0, 0.80)
    assert [(d.node, d.command.kind) for d in res.decisions] == [("s-lp", "lock_clocks")]
    d = res.decisions[0]
    assert isinstance(d.command, LockClocks)
    assert d.command.max_mhz == 1275 and d.command.min_mhz == 210
    assert d.knob is Knob.CLOCKS and d.domain == "row-a" and d.level is Level.T1
    assert d.threshold_frac == pytest.approx(0.80) and d.domain_power_w == pytest.approx(800)
    assert "row-a" in d.reason and "80" in d.reason
    assert loop.hp() is None


def test_t2_lowers_low_priority_first_then_high_priority_if_still_above() -> None:
    loop = Loop(PowerPolicy(tree({"escalate_after_s": 5})))
    loop.tick(0.0, 0.90)
    assert loop.lp() == 1110 and loop.hp() is None
    assert loop.policy.level("row-a") is Level.T2_LP
    loop.tick(4.0, 0.90)
    assert loop.hp() is None  # not yet: low priority's cut may still land
    loop.tick(5.0, 0.90)
    assert loop.policy.level("row-a") is Level.T2_HP
    assert loop.lp() == 1110 and loop.hp() == 1305


def test_t2_does_not_touch_high_priority_when_low_priority_cut_suffices() -> None:
    loop = Loop(PowerPolicy(tree({"escalate_after_s": 5})))
    loop.tick(0.0, 0.90)
    for t in range(1, 30):
        loop.tick(float(t), 0.86)
    assert loop.policy.level("row-a") is Level.T2_LP
    assert loop.hp() is None and loop.lp() == 1110


def test_brake_caps_everything_to_lowest_clock_and_raises_incident() -> None:
    policy = PowerPolicy(tree())
    loop = Loop(policy)
    res = loop.tick(0.0, 1.01)
    assert loop.lp() == 210 and loop.hp() == 210
    assert policy.level("row-a") is Level.BRAKE
    assert [i.kind for i in res.incidents] == ["brake"]
    assert policy.brake_events == 1
    loop.tick(1.0, 1.02)
    assert policy.brake_events == 1  # one event, not one per tick


def test_uncap_needs_hysteresis_and_hold_time() -> None:
    loop = Loop(PowerPolicy(tree({"min_hold_s": 60, "hysteresis_frac": 0.05})))
    loop.tick(0.0, 0.82)
    assert loop.lp() == 1275
    loop.tick(100.0, 0.77)  # below T1 but within the 5-point band
    assert loop.lp() == 1275
    loop.tick(101.0, 0.80)
    loop.tick(102.0, 0.74)
    assert loop.lp() is None  # hold time counts from the cap (t=0), band left: uncap


def test_hold_time_blocks_an_early_uncap() -> None:
    loop = Loop(PowerPolicy(tree({"min_hold_s": 60})))
    loop.tick(0.0, 0.82)
    loop.tick(30.0, 0.50)
    assert loop.lp() == 1275
    loop.tick(59.0, 0.50)
    assert loop.lp() == 1275
    loop.tick(60.0, 0.50)
    assert loop.lp() is None


def test_uncap_steps_down_one_level_per_hold() -> None:
    loop = Loop(PowerPolicy(tree({"min_hold_s": 10, "escalate_after_s": 1})))
    loop.tick(0.0, 0.95)
    loop.tick(1.0, 0.95)
    assert loop.policy.level("row-a") is Level.T2_HP
    loop.tick(11.0, 0.50)
    assert loop.policy.level("row-a") is Level.T2_LP
    assert loop.hp() is None and loop.lp() == 1110
    loop.tick(12.0, 0.50)
    assert loop.lp() == 1110  # the next step waits another hold
    loop.tick(21.0, 0.50)
    assert loop.policy.level("row-a") is Level.T1 and loop.lp() == 1275
    loop.tick(31.0, 0.50)
    assert loop.policy.level("row-a") is Level.NONE and loop.lp() is None


def test_stale_telemetry_holds_caps_and_raises_one_incident() -> None:
    loop = Loop(PowerPolicy(tree({"min_hold_s": 10, "stale_after_s": 5})))
    loop.tick(0.0, 0.85)
    assert loop.lp() == 1275
    incidents = []
    for t in range(1, 100):
        res = loop.tick(float(t), None)  # the agents went silent
        incidents.extend(res.incidents)
        assert res.decisions == []
    assert loop.lp() == 1275
    assert [i.kind for i in incidents] == ["telemetry_stale"]
    loop.tick(100.0, 0.30)  # telemetry back: now the uncap is informed
    assert loop.lp() is None


def test_stale_part_still_escalates_on_the_fresh_lower_bound() -> None:
    policy = PowerPolicy(tree({"stale_after_s": 5}))
    loop = Loop(policy)
    loop.tick(0.0, 0.5)
    # The row meter and one server go silent; the other server alone is above T1.
    res = policy.tick(10.0, {"s-hp": Reading(850.0, 10.0)}, loop.gpus)
    assert policy.level("row-a") is Level.T1
    assert [d.node for d in res.decisions] == ["s-lp"]
    assert not res.domains["row-a"].complete


def test_failed_clock_command_escalates_to_power_limit() -> None:
    loop = Loop(PowerPolicy(tree()))
    loop.fail_kinds = {"lock_clocks"}
    loop.tick(0.0, 0.85)
    assert loop.lp() is None
    res = loop.tick(1.0, 0.85)
    assert [i.kind for i in res.incidents] == ["clock_command_failed"]
    assert "Insufficient Permissions" in res.incidents[0].message
    assert [d.command.kind for d in res.decisions] == ["set_power_limit"]
    d = res.decisions[0]
    assert d.knob is Knob.POWER_LIMIT and "clock lock failed" in d.reason
    assert isinstance(d.command, SetPowerLimit)
    assert 100 < d.command.limit_w < 400  # between the A100's min and max limit
    loop.tick(2.0, 0.85)
    assert loop.limit[("s-lp", 0)] == d.command.limit_w
    # Later caps for this GPU keep using the power-limit knob; harder cap, lower limit.
    loop.tick(3.0, 0.95)
    assert loop.limit[("s-lp", 0)] is not None
    assert loop.limit[("s-lp", 0)] < d.command.limit_w  # type: ignore[operator]


def test_both_knobs_failing_reports_gpu_uncontrollable_and_stops() -> None:
    loop = Loop(PowerPolicy(tree()))
    loop.fail_kinds = {"lock_clocks", "set_power_limit"}
    loop.tick(0.0, 0.85)
    loop.tick(1.0, 0.85)
    res = loop.tick(2.0, 0.85)
    assert [i.kind for i in res.incidents] == ["power_limit_command_failed"]
    assert "no knob left" in res.incidents[0].message
    assert loop.tick(3.0, 0.85).decisions == []


def test_power_limit_knob_by_domain_policy() -> None:
    loop = Loop(PowerPolicy(tree({"knob": "power_limit"})))
    res = loop.tick(0.0, 1.05)
    kinds = sorted(d.command.kind for d in res.decisions)
    assert kinds == ["set_power_limit", "set_power_limit"]
    limits = {
        d.node: d.command.limit_w for d in res.decisions if isinstance(d.command, SetPowerLimit)
    }
    assert limits == {"s-lp": 100.0, "s-hp": 100.0}  # brake: the A100's minimum limit
    assert all("prefers" in d.reason for d in res.decisions)


def test_unacknowledged_command_is_resent_after_timeout_only() -> None:
    policy = PowerPolicy(tree({"command_timeout_s": 30}))
    first = policy.tick(0.0, readings(0.85, 0.0), [LP])
    assert len(first.decisions) == 1
    assert policy.tick(10.0, readings(0.85, 10.0), [LP]).decisions == []
    again = policy.tick(31.0, readings(0.85, 31.0), [LP])
    assert [d.command.kind for d in again.decisions] == ["lock_clocks"]
    assert again.decisions[0].command.id != first.decisions[0].command.id
    # The late ack of the superseded command changes nothing.
    late = CommandAck(command_id=first.decisions[0].command.id, status=CommandStatus.SUCCEEDED)
    assert policy.tick(32.0, readings(0.85, 32.0), [LP], [late]).decisions == []


def test_caps_found_at_first_sight_are_adopted_not_lifted_blindly() -> None:
    policy = PowerPolicy(tree({"min_hold_s": 60}))
    capped = GpuStatus(
        server="s-lp", index=0, model="A100", priority=Priority.LOW, locked_sm_clock_mhz=1110
    )
    assert policy.tick(0.0, readings(0.3, 0.0), [capped]).decisions == []
    assert policy.tick(59.0, readings(0.3, 59.0), [capped]).decisions == []
    res = policy.tick(60.0, readings(0.3, 60.0), [capped])
    assert [d.command.kind for d in res.decisions] == ["unlock_clocks"]


def test_most_restrictive_domain_wins() -> None:
    raw = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 10_000,
        "children": [
            {
                "name": "rack-1",
                "kind": "rack",
                "budget_w": 1000,
                "children": [{"name": "s-lp", "kind": "server", "budget_w": 2000}],
            }
        ],
    }
    policy = PowerPolicy(parse_domains(raw))
    r = {"row-a": Reading(9000.0, 0.0), "rack-1": Reading(950.0, 0.0), "s-lp": Reading(950.0, 0.0)}
    res = policy.tick(0.0, r, [LP])
    (d,) = res.decisions
    assert isinstance(d.command, LockClocks)
    assert d.command.max_mhz == 1110  # the rack at 95% (T2) beats the row at 90% (T2 too)
    assert d.domain in {"rack-1", "row-a"}
    r["row-a"] = Reading(8100.0, 0.0)
    policy2 = PowerPolicy(parse_domains(raw))
    (d2,) = policy2.tick(0.0, r, [LP]).decisions
    assert d2.domain == "rack-1" and d2.level is Level.T2_LP


def test_per_domain_thresholds_and_clock_overrides() -> None:
    loop = Loop(
        PowerPolicy(tree({"t1_frac": 0.6, "clock_overrides_mhz": {"a100": {"lp_t1": 1200}}}))
    )
    loop.tick(0.0, 0.65)
    assert loop.lp() == 1200


def test_unknown_model_with_power_limits_uses_power_limit_knob() -> None:
    odd = GpuStatus(
        server="s-lp",
        index=0,
        model="Mystery GPU",
        priority=Priority.LOW,
        power_limit_min_w=150.0,
        power_limit_max_w=500.0,
    )
    policy = PowerPolicy(tree())
    (d,) = policy.tick(0.0, readings(0.85, 0.0), [odd]).decisions
    assert d.knob is Knob.POWER_LIMIT and "no clock range known" in d.reason
    assert isinstance(d.command, SetPowerLimit) and 150 <= d.command.limit_w < 500


def test_policy_config_rejects_inverted_thresholds() -> None:
    with pytest.raises(ValueError, match="t1_frac <= t2_frac"):
        PolicyConfig(t1_frac=0.9, t2_frac=0.8)


@pytest.mark.parametrize(
    "field", ["min_hold_s", "escalate_after_s", "stale_after_s", "command_timeout_s"]
)
@pytest.mark.parametrize("value", [1e308, 86_401.0, float("inf"), True])
def test_policy_times_past_a_day_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^policy.{field}: must be a number of seconds in"):
        PolicyConfig(**{field: value})  # type: ignore[arg-type]
    assert getattr(PolicyConfig(**{field: 86_400.0}), field) == 86_400.0  # type: ignore[arg-type]


def test_effects_report_power_before_after_and_time_to_show() -> None:
    loop = Loop(PowerPolicy(tree({"min_hold_s": 10})))
    first = loop.tick(0.0, 0.85)
    assert first.effects == []
    assert loop.tick(1.0, 0.85).effects == []  # the cap has not shown yet
    (eff,) = loop.tick(2.0, 0.81).effects
    assert (eff.domain, eff.from_level, eff.to_level) == ("row-a", Level.NONE, Level.T1)
    assert eff.observed and eff.latency_s == 2.0
    assert eff.power_before_w == pytest.approx(850.0) and eff.power_after_w == pytest.approx(810)
    # An uncap on a quiet row changes nothing: reported as unobserved after the timeout.
    loop.tick(20.0, 0.5)
    assert loop.policy.level("row-a") is Level.NONE
    assert loop.tick(100.0, 0.5).effects == []
    (late,) = loop.tick(140.0, 0.5).effects
    assert late.to_level is Level.NONE and not late.observed and late.latency_s == 120.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.5, max_value=30.0),
            st.one_of(st.none(), st.floats(min_value=0.3, max_value=1.2)),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_invariants_hold_for_any_power_sequence(steps: list[tuple[float, float | None]]) -> None:
    """Whatever the row does: high priority is never capped while low priority runs free,
    brake means everything at the lowest clock, and a blind tick never lifts a cap."""
    loop = Loop(PowerPolicy(tree({"min_hold_s": 20, "escalate_after_s": 3, "stale_after_s": 2})))
    now = 0.0
    for dt, frac in steps:
        now += dt
        res = loop.tick(now, frac)
        lp, hp = loop.lp(), loop.hp()
        if hp is not None:
            assert lp is not None and lp <= 1110
        if hp == 210 or lp == 210:
            assert hp == lp == 210 and loop.policy.level("row-a") is Level.BRAKE
        if frac is None:
            assert not [d for d in res.decisions if d.command.kind == "unlock_clocks"]
