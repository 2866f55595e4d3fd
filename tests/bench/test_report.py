"""bench.report: the machine, each bench's label and command, and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.report as report


def test_report_lists_machine_labels_commands_and_writes_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    run = {"command": "python -m bench.recovery --json --quick", "elapsed_s": 1.0,
           "label": report.LABELS["recovery"]}  # fmt: skip
    (tmp_path / "recovery.json").write_text(
        json.dumps({"_run": run, "goodput": 0.8, "baseline_goodput": 0.1, "mttr_s": 30.0})
    )
    (tmp_path / "detect.json").write_text(
        json.dumps(
            {
                "_run": {**run, "command": "python -m bench.detect --json --quick"},
                "detect_s": [3.0, 5.0, 8.0],
                "baselines": [{"name": "pytorch defaults", "detect_s": [0.1, 600.0, None]}],
            }
        )
    )
    (tmp_path / "power.json").write_text(
        json.dumps(
            {
                "_run": run,
                "timeline_bursty_ours": {
                    "t_s": [0.0, 1.0, 2.0],
                    "uncapped_frac": [0.9, 1.05, 0.95],
                    "controlled_frac": [0.9, 0.97, 0.95],
                    "extra_servers": 12,
                },
            }
        )
    )
    out = report.write_report(list(report.BENCHES), "quick runs on a shared machine")
    text = out.read_text()
    assert "cores:" in text and "torch" in text and "disk:" in text
    assert "`python -m bench.recovery --json --quick`" in text
    assert report.LABELS["recovery"] in text
    assert "| traffic | simulated (flow-level model) | - | not run | - |" in text
    assert "goodput = 0.8" in text and "baseline_goodput = 0.1" in text
    for png in ("detection_cdf.png", "goodput.png", "power_timeline.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"]({png})" in text
