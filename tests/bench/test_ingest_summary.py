"""``bench.ingest``'s verdicts, without running a benchmark: which level counts as kept up
and what the JSON says about a backend it could not measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.ingest import Level, best_level, summarize


def _level(nodes: int, *, kept: bool, p99_ms: float = 50.0) -> Level:
    return Level(
        nodes=nodes, offered_per_s=nodes / 5, answered_per_s=nodes / 5, keep_up_ratio=1.0,
        failures=0, p50_ms=20.0, p99_ms=p99_ms, max_ms=p99_ms, cpu_ms_per_report=1.5,
        kept_up=kept,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("verdicts", "max_nodes"),
    [
        ({256: True, 1024: True, 2048: True}, 2048),
        ({256: True, 1024: True, 2048: True, 2560: False}, 2048),
        # A level that passes above one that failed is noise, not capacity.
        ({256: True, 1024: True, 2048: False, 2560: True}, 1024),
        ({256: True, 512: False, 1024: True, 2048: True}, 256),
        ({256: False, 1024: True, 2048: True}, 0),
    ],
)
def test_max_nodes_stops_at_the_first_failed_level(
    verdicts: dict[int, bool], max_nodes: int
) -> None:
    levels = [_level(n, kept=ok, p99_ms=40.0 + n / 100) for n, ok in verdicts.items()]
    summary = summarize(levels)
    assert summary["max_nodes"] == max_nodes
    best = best_level(levels)
    if max_nodes:
        assert best is not None and best.nodes == max_nodes
        assert summary["p99_ms"] == round(40.0 + max_nodes / 100, 2)
        assert summary["gpu_samples_per_s"] == max_nodes / 5 * 5 * 8
    else:
        assert best is None and summary["p99_ms"] is None


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_unreachable_postgres_is_an_explicit_entry_in_json_and_table() -> None:
    env = {"TRAINGUARD_TEST_PG": "postgresql://postgres:secret@127.0.0.1:1/postgres"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "--backends", "postgres", "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    entry = summary["postgres"]
    assert entry["max_nodes"] is None and entry["p99_ms"] is None
    assert entry["gpu_samples_per_s"] is None
    assert "unavailable" in entry["error"] and "secret" not in entry["error"]
    assert any(line.startswith("postgres  not measured: ") for line in lines[:-1])
