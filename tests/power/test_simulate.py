"""Simulator invariants on generated and hand-built traces."""

from __future__ import annotations

import numpy as np
import pytest

from power.config import PolicyConfig, Priority, WorkloadKind
from power.generate import GeneratorConfig, generate
from power.search import Limits, max_extra_servers
from power.simulate import Control, SimConfig, simulate
from power.traces import ServerTrace, Trace


@pytest.fixture(scope="module")
def row() -> Trace:
    """A compressed day: 40 servers plus spares, 2 h, one diurnal cycle."""
    return generate(GeneratorConfig(servers=56, seed=3, duration_s=7200, period_s=7200))


def hand_trace(rows_w: list[list[float]], priorities: list[Priority]) -> Trace:
    servers = [
        ServerTrace(
            name=f"s{i}",
            priority=prio,
            workload=WorkloadKind.INFERENCE,
            gpu_power_w=np.array(watts, dtype=np.float64),
            other_power_w=np.zeros(len(watts)),
        )
        for i, (watts, prio) in enumerate(zip(rows_w, priorities, strict=True))
    ]
    return Trace(step_s=1.0, start_s=0.0, servers=servers)


def test_no_oversubscription_means_no_caps(row: Trace) -> None:
    r = simulate(row, SimConfig(extra_servers=0))
    assert r.peak_row_frac < 0.8
    assert r.commands == 0
    assert all(v == 0 for v in r.time_capped_s.values())
    assert r.hp_throughput_loss_pct == 0 and r.lp_throughput_loss_pct == 0
    assert r.brake_events == 0 and r.budget_violation_s == 0


def test_more_servers_means_more_capping(row: Trace) -> None:
    runs = [simulate(row, SimConfig(extra_servers=e)) for e in (4, 10, 16)]
    capped = [sum(r.time_capped_s.values()) for r in runs]
    assert capped[0] < capped[1] < capped[2]
    assert runs[0].lp_throughput_loss_pct <= runs[1].lp_throughput_loss_pct
    assert runs[1].lp_throughput_loss_pct <= runs[2].lp_throughput_loss_pct


def test_low_priority_is_capped_before_high_priority(row: Trace) -> None:
    r = simulate(row, SimConfig(extra_servers=6))
    assert r.time_capped_s["T1"] > 0
    assert r.lp_throughput_loss_pct > 0
    assert r.hp_throughput_loss_pct == 0
    blind = simulate(row, SimConfig(extra_servers=12, control=Control.REACTIVE))
    assert blind.hp_throughput_loss_pct > 0  # the priority-blind baseline hits everyone


def test_violations_are_counted_exactly_on_a_hand_built_trace() -> None:
    # Budget 2 x 1000 W. Row: 1800, 2100 (+5%), 2200 (+10%), 1900, 2050 (+2.5%), 1000.
    a = [900.0, 1050.0, 1100.0, 950.0, 1025.0, 500.0]
    trace = hand_trace([a, a], [Priority.HIGH, Priority.LOW])
    r = simulate(
        trace, SimConfig(base_servers=2, server_provisioned_w=1000.0, control=Control.NONE)
    )
    assert r.budget_violation_s == 3.0
    assert r.worst_overshoot_pct == pytest.approx(10.0)
    assert r.brake_events == 2  # two separate crossings of 100%
    assert r.peak_row_frac == pytest.approx(1.1)


def test_in_band_actuation_cuts_the_overshoot_that_40s_lets_through() -> None:
    # Both servers jump from 60% to 105% of budget at t=100 and stay there for 200 s.
    watts = [600.0] * 100 + [1050.0] * 200 + [600.0] * 100
    trace = hand_trace([watts, watts], [Priority.HIGH, Priority.LOW])
    base = SimConfig(
        base_servers=2,
        server_provisioned_w=1000.0,
        gpu_model="A100",
        gpus_per_server=2,
        policy=PolicyConfig(escalate_after_s=2),
    )
    fast = simulate(trace, SimConfig(**{**_fields(base), "actuation_latency_s": 0.05}))
    slow = simulate(trace, SimConfig(**{**_fields(base), "actuation_latency_s": 40.0}))
    assert fast.budget_violation_s == 1.0  # seen at the jump, capped one step later
    assert slow.budget_violation_s == 40.0
    assert fast.brake_events == slow.brake_events == 1


def _fields(cfg: SimConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__slots__}  # type: ignore[attr-defined]


def test_extra_servers_beyond_the_trace_are_time_shifted_copies(row: Trace) -> None:
    r = simulate(row, SimConfig(base_servers=40, extra_servers=30))  # trace has 56
    assert r.servers == 70


def test_search_finds_the_boundary(row: Trace) -> None:
    limits = Limits(hp_loss_pct=1.0, lp_loss_pct=2.0)
    n, at = max_extra_servers(row, SimConfig(control=Control.NONE), limits=limits, upper=20)
    assert at.brake_events == 0
    over = simulate(row, SimConfig(control=Control.NONE, extra_servers=n + 1))
    assert over.brake_events > 0  # one more server and the uncapped row trips
