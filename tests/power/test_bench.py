"""``bench.power`` scores every scheme on a day its thresholds were not derived from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench import power as bench
from power.config import WorkloadKind
from power.derive import derive_thresholds
from power.generate import SERVER_PROVISIONED_W, GeneratorConfig, generate
from power.simulate import SimConfig, uncapped_row_w
from power.traces import Trace

#: A latency like the one ``bench.power`` measures through the agent path at 1 s reports
#: (``bench.power_actuation``); the bench no longer has a constant for it.
LATENCY_S = 1.05


def _day(seed: int) -> Trace:
    return generate(
        GeneratorConfig(servers=bench.BASE + 4, seed=seed, duration_s=1800.0, period_s=1800.0)
    )


def _with_spike(trace: Trace, at: int, w: float) -> Trace:
    """The same day with a one-step jump of ``w`` watts on every server."""
    servers = []
    for s in trace.servers:
        gpu = s.gpu_power_w.copy()
        gpu[at:] += w
        servers.append(dataclasses.replace(s, gpu_power_w=gpu))
    return Trace(step_s=trace.step_s, start_s=trace.start_s, servers=servers)


def test_derived_thresholds_come_from_the_derivation_day_only() -> None:
    derive_day = _day(1000)
    scored = _with_spike(_day(0), 900, 200.0)  # a 5% jump the bench must not see
    for name, cfg in bench.schemes(derive_day, LATENCY_S):
        if not callable(cfg):
            continue
        run = cfg(2)
        expected = derive_thresholds(
            uncapped_row_w(derive_day, bench.BASE + 2),
            bench.BASE * SERVER_PROVISIONED_W,
            step_s=1.0,
            actuation_latency_s=run.actuation_latency_s,
            tick_interval_s=run.tick_interval_s,
        )
        assert (run.policy.t1_frac, run.policy.t2_frac) == (expected.t1_frac, expected.t2_frac)
        in_sample = derive_thresholds(
            uncapped_row_w(scored, bench.BASE + 2),
            bench.BASE * SERVER_PROVISIONED_W,
            step_s=1.0,
            actuation_latency_s=run.actuation_latency_s,
            tick_interval_s=run.tick_interval_s,
        )
        assert in_sample.t2_frac < run.policy.t2_frac, name  # the spike would have lowered it


def test_scored_and_derivation_days_differ() -> None:
    scored, derive_day = bench.row_traces(
        WorkloadKind.INFERENCE, quick=True, seed=3, derive_seed=1003
    )
    assert scored.n_steps == derive_day.n_steps == 4 * 3600
    assert not np.array_equal(scored.row_power_w(), derive_day.row_power_w())
    with pytest.raises(SystemExit, match="must differ"):
        bench.row_traces(WorkloadKind.INFERENCE, quick=True, seed=3, derive_seed=3)


def test_latencies_are_the_given_one_and_the_agents_default() -> None:
    import agents.settings

    default_report = agents.settings.AgentSettings.model_fields["report_interval_s"].default
    assert default_report == bench.DEFAULT_REPORT_S
    rows = dict(bench.schemes(_day(1000), LATENCY_S))
    ours = rows[bench.OURS]
    ours_default = rows[bench.OURS_DEFAULT]
    assert callable(ours) and callable(ours_default)
    fast, slow = ours(0), ours_default(0)
    assert isinstance(fast, SimConfig) and isinstance(slow, SimConfig)
    assert (fast.actuation_latency_s, fast.tick_interval_s) == (LATENCY_S, 1.0)
    assert (slow.actuation_latency_s, slow.tick_interval_s) == (5.0, 5.0)
    oob = rows["POLCA, 40 s out-of-band"]
    assert isinstance(oob, SimConfig) and oob.actuation_latency_s == 40.0


def test_run_row_scores_on_the_seed_and_derives_from_the_other_day(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Trace] = {}
    real_schemes = bench.schemes

    def schemes(derive_trace: Trace, latency_s: float) -> object:
        seen["derive"] = derive_trace
        return real_schemes(derive_trace, latency_s)

    def search(trace: Trace, cfg: object, **_: object) -> tuple[int, object]:
        seen.setdefault("scored", trace)
        assert trace is seen["scored"]
        return 0, None

    monkeypatch.setattr(bench, "schemes", schemes)
    monkeypatch.setattr(bench, "max_extra_servers", search)
    monkeypatch.setattr(bench, "simulate", lambda trace, cfg: None)
    res = bench.run_row(WorkloadKind.INFERENCE, quick=True, seed=0, derive_seed=1000, latency_s=0.5)
    assert res["trace"] is seen["scored"] and res["derive_trace"] is seen["derive"]
    assert seen["scored"] is not seen["derive"]
    expected = bench.row_traces(WorkloadKind.INFERENCE, quick=True, seed=0, derive_seed=1000)
    assert np.array_equal(seen["scored"].row_power_w(), expected[0].row_power_w())
    assert np.array_equal(seen["derive"].row_power_w(), expected[1].row_power_w())
