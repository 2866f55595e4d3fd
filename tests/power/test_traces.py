"""Trace files (CSV, Parquet) and the synthetic generator's published shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from power.config import Priority, WorkloadKind
from power.errors import TraceError
from power.generate import GeneratorConfig, generate
from power.traces import load_trace, save_trace

HEADER = "time_s,server,gpu_power_w,priority,workload\n"


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    trace = generate(GeneratorConfig(servers=3, duration_s=120, seed=1))
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    back = load_trace(path)
    assert [s.name for s in back.servers] == [s.name for s in trace.servers]
    assert back.step_s == 1.0 and back.n_steps == 120
    for a, b in zip(trace.servers, back.servers, strict=True):
        assert a.priority is b.priority and a.workload is b.workload
        np.testing.assert_allclose(a.gpu_power_w, b.gpu_power_w, atol=0.06)
        np.testing.assert_allclose(a.other_power_w, b.other_power_w, atol=0.06)
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temp file


def test_rows_may_come_in_any_order(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(
        HEADER + "1,b,20,low,decode\n0,a,1,high,prefill\n0,b,10,low,decode\n1,a,2,high,prefill\n"
    )
    tr = load_trace(p)
    assert [s.name for s in tr.servers] == ["b", "a"]
    assert tr.servers[0].gpu_power_w.tolist() == [10.0, 20.0]
    assert tr.servers[0].priority is Priority.LOW
    assert tr.servers[1].workload is WorkloadKind.PREFILL
    assert tr.servers[1].other_power_w.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("", "empty file"),
        ("time_s,server,gpu_power_w,priority\n0,a,1,high\n", "missing column 'workload'"),
        (HEADER.strip() + ",colour\n", "unknown column 'colour'"),
        (HEADER, "no data rows"),
        (HEADER + "0,a,1,high,training\n1,a,x,high,training\n", "t.csv:3: gpu_power_w must be"),
        (HEADER + "0,a,-1,high,training\n1,a,1,high,training\n", "t.csv:2: gpu_power_w must be"),
        (HEADER + "0,a,1,urgent,training\n", "t.csv:2: priority must be one of"),
        (HEADER + "0,a,1,high,gaming\n", "t.csv:2: workload must be one of"),
        (HEADER + "0,a,1,high,training\n1,a,1,low,training\n", "changes priority or workload"),
        (HEADER + "0,a,1,high,training\n1,a,1\n", "t.csv:3: expected 5 fields, got 3"),
        (
            HEADER + "0,a,1,high,training\n1,a,1,high,training\n3,a,1,high,training\n",
            "not evenly spaced",
        ),
        (
            HEADER + "0,a,1,high,training\n1,a,1,high,training\n0,b,1,high,training\n",
            "server 'b' does not cover the same time steps",
        ),
        (HEADER + "0,a,1,high,training\n", "at least two time steps"),
    ],
)
def test_bad_csv_gives_one_line_error_with_location(
    tmp_path: Path, body: str, message: str
) -> None:
    p = tmp_path / "t.csv"
    p.write_text(body)
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(TraceError, match=r"expected \.csv or \.parquet"):
        load_trace(tmp_path / "t.txt")
    (tmp_path / "t.parquet").write_text("not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet file"):
        load_trace(tmp_path / "t.parquet")


def _rise(row: np.ndarray, steps: int) -> float:
    w = sliding_window_view(row, steps + 1)
    return float((w.max(axis=1) - w[:, 0]).max())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inference_trace_matches_the_published_shape(seed: int) -> None:
    cfg = GeneratorConfig(servers=40, seed=seed, duration_s=4 * 3600, period_s=4 * 3600)
    row = generate(cfg).row_power_w() / (40 * cfg.server_provisioned_w)
    assert row.max() == pytest.approx(0.79, abs=0.005)
    assert _rise(row, 40) <= 0.12  # POLCA: largest spike 11.8% within 40 s
    assert row.mean() < 0.65  # a diurnal row is well below its peak most of the time


def test_training_trace_peaks_high_and_dips_in_sync() -> None:
    cfg = GeneratorConfig(
        kind=WorkloadKind.TRAINING, servers=16, seed=0, duration_s=1800, job_servers=8
    )
    trace = generate(cfg)
    row = trace.row_power_w() / (16 * cfg.server_provisioned_w)
    assert row.max() == pytest.approx(0.97, abs=0.005)
    job = np.stack([s.gpu_power_w for s in trace.servers[:8]])
    rel = np.diff(job, axis=1) / job[:, :-1]
    job_dips = rel.mean(axis=0) < -0.2
    # Iteration-boundary dips land on the same step for every server of the job.
    assert job_dips.sum() > 50
    assert (rel[:, job_dips] < -0.1).all()
    assert _rise(row, 2) > 0.15  # POLCA: training swings 37.5% within 2 s at row scale
    assert {s.priority for s in trace.servers[:8]} == {trace.servers[0].priority}


def test_generator_is_seeded() -> None:
    a = generate(GeneratorConfig(servers=4, seed=7, duration_s=300))
    b = generate(GeneratorConfig(servers=4, seed=7, duration_s=300))
    c = generate(GeneratorConfig(servers=4, seed=8, duration_s=300))
    assert np.array_equal(a.row_power_w(), b.row_power_w())
    assert not np.array_equal(a.row_power_w(), c.row_power_w())
