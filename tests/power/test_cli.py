"""``trainguard power …`` commands: output shapes and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from power.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "row.csv"
    res = runner.invoke(
        app, ["generate", str(path), "--servers", "12", "--duration-s", "1800", "--seed", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "row peak 79" in res.output
    return path


def test_simulate_table_and_json(trace_file: Path) -> None:
    res = runner.invoke(app, ["simulate", str(trace_file), "--base-servers", "10", "--extra", "2"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].split() == ["METRIC", "VALUE"]
    assert "12 (10 + 2, +20.0%)" in res.output
    res = runner.invoke(
        app,
        [
            "simulate",
            str(trace_file),
            "--base-servers",
            "10",
            "--extra",
            "2",
            "--derive",
            "-o",
            "json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    for key in (
        "hp_throughput_loss_pct",
        "lp_throughput_loss_pct",
        "p99_latency_impact_pct",
        "time_capped_s",
        "brake_events",
        "budget_violation_s",
        "worst_overshoot_pct",
    ):
        assert key in doc
    assert doc["servers"] == 12 and doc["policy"]["t2_frac"] > 0.89  # derived, in-band


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "/nonexistent/row.csv"], "error: /nonexistent/row.csv: no such file"),
        (["simulate", "{trace}", "--t1", "0.95", "--t2", "0.9"], "error: policy: thresholds"),
        (["simulate", "{trace}", "--gpu-model", "Mystery"], "not in the clock table"),
        (["domains", "/nonexistent/d.yaml"], "error: /nonexistent/d.yaml: cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trace_file: Path, args: list[str], message: str) -> None:
    res = runner.invoke(app, [a.replace("{trace}", str(trace_file)) for a in args])
    assert res.exit_code == 2
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_usage_errors_exit_2(trace_file: Path) -> None:
    assert runner.invoke(app, ["simulate", str(trace_file), "--extra", "-3"]).exit_code == 2
    assert runner.invoke(app, ["simulate"]).exit_code == 2
    assert runner.invoke(app, ["simulate", str(trace_file), "--control", "magic"]).exit_code == 2


def test_bad_trace_content_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("time_s,server,gpu_power_w,priority,workload\n0,a,lots,high,training\n")
    res = runner.invoke(app, ["simulate", str(p)])
    assert res.exit_code == 2
    assert "bad.csv:2: gpu_power_w must be a number" in res.stderr


def test_derive(trace_file: Path) -> None:
    res = runner.invoke(app, ["derive", str(trace_file), "--base-servers", "10", "-o", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["t2_plus_spike_pct"] < 100
    assert doc["t1_pct"] < doc["t2_pct"]
    assert doc["polca_window_spike_pct"] >= doc["spike_pct"]


def test_domains_and_clocks(tmp_path: Path) -> None:
    p = tmp_path / "d.yaml"
    p.write_text(
        "name: row-a\nkind: row\nbudget_w: 168000\npolicy: {t2_frac: 0.93}\n"
        "children:\n  - {name: node-1, kind: server, budget_w: 4200}\n"
    )
    res = runner.invoke(app, ["domains", str(p)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "BUDGET_W", "T1", "T2", "BRAKE", "KNOB"]
    assert lines[2].split() == ["node-1", "server", "4200", "80%", "93%", "100%", "clocks"]
    p.write_text("name: row-a\nkind: row\nbudget_w: -1\n")
    res = runner.invoke(app, ["domains", str(p)])
    assert res.exit_code == 2 and "domains.budget_w: must be a positive" in res.stderr
    res = runner.invoke(app, ["clocks", "-o", "json"])
    rows = {r["model"]: r for r in json.loads(res.output)}
    assert rows["a100"]["lp_t1"] == 1275 and set(rows) == {"a100", "h100", "h200", "b200", "l40s"}


def test_module_import_stays_light() -> None:
    code = "import sys, power.cli; print('numpy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_derive_search_reports_servers_each_t2_allows(trace_file: Path) -> None:
    res = runner.invoke(
        app, ["derive", str(trace_file), "--base-servers", "8", "--search", "-o", "json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["extra_servers_derived_thresholds"] >= doc["extra_servers_polca_thresholds"] >= 0
    slow = json.loads(
        runner.invoke(
            app,
            ["derive", str(trace_file), "--base-servers", "8", "--latency-s", "40", "-o", "json"],
        ).output
    )
    assert slow["t2_pct"] < doc["t2_pct"] and slow["window_s"] == 41.0


def test_simulate_derive_never_sees_the_replayed_steps(trace_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-day.csv"
    res = runner.invoke(
        app, ["generate", str(other), "--servers", "12", "--duration-s", "1800", "--seed", "7"]
    )
    assert res.exit_code == 0, res.output
    common = ["--base-servers", "10", "--extra", "2", "-o", "json"]

    def run(*args: str) -> dict[str, Any]:
        out = runner.invoke(app, ["simulate", str(trace_file), *common, *args])
        assert out.exit_code == 0, out.output
        doc: dict[str, Any] = json.loads(out.output)
        return doc

    def derived_t2(path: Path) -> float:
        out = runner.invoke(app, ["derive", str(path), *common[:4], "-o", "json"])
        return float(json.loads(out.output)["t2_pct"]) / 100

    # Another day: thresholds from it, the whole scored trace replayed.
    doc = run("--derive-from", str(other))
    assert doc["policy"]["derived_from"] == str(other)
    assert doc["duration_s"] == 1800
    assert doc["policy"]["t2_frac"] == pytest.approx(derived_t2(other), abs=1e-4)
    # No other day: derive from the first half, replay only the second.
    doc = run("--derive")
    assert doc["duration_s"] == 900
    assert doc["policy"]["derived_from"].startswith("first half of")
    assert run()["policy"]["derived_from"] is None


def test_derive_search_on_a_held_out_trace(trace_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-day.csv"
    runner.invoke(app, ["generate", str(other), "--servers", "12", "--duration-s", "900"])
    base = ["derive", str(trace_file), "--base-servers", "8", "--search", "-o", "json"]
    held_out = json.loads(runner.invoke(app, [*base, "--score-on", str(other)]).output)
    assert held_out["search_in_sample"] is False
    assert json.loads(runner.invoke(app, base).output)["search_in_sample"] is True
