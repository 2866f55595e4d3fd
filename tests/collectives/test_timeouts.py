"""Timeout ordering: torch settings that would end a hung job before trainguard acts."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import collectives
from collectives.timeouts import live_timeouts, timeout_findings

NEEDED = 300.0


def test_defaults_are_quiet() -> None:
    assert timeout_findings({"default": ("nccl", 600.0)}, {}, NEEDED) == []
    assert timeout_findings({"default": ("gloo", 1800.0)}, {}, NEEDED) == []


def test_a_short_nccl_timeout_with_teardown_is_named_with_a_working_value() -> None:
    (line,) = timeout_findings({"0": ("nccl", 60.0)}, {}, NEEDED)
    assert "times out after 60 s" in line
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in line  # torch's default
    assert "timeout=timedelta(seconds=300)" in line
    (line,) = timeout_findings({"0": ("nccl", 60.0)}, {"TORCH_NCCL_BLOCKING_WAIT": "1"}, NEEDED)
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in line
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert timeout_findings({"0": ("nccl", 60.0)}, env, NEEDED) == []  # aborted, not killed


def test_a_short_gloo_timeout_raises_in_the_job() -> None:
    (line,) = timeout_findings({"1": ("gloo", 30.0)}, {}, NEEDED)
    assert "(gloo)" in line and "raises" in line


def test_the_nccl_heartbeat_monitor_is_checked_unless_off() -> None:
    env = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "120"}
    (line,) = timeout_findings({"0": ("nccl", 600.0)}, env, NEEDED)
    assert line.startswith("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=120") and "300 or more" in line
    env["TORCH_NCCL_ENABLE_MONITORING"] = "0"
    assert timeout_findings({"0": ("nccl", 600.0)}, env, NEEDED) == []
    assert (
        timeout_findings({"0": ("gloo", 1800.0)}, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1"}, NEEDED)
        == []
    )


def test_instrument_warns_about_the_live_group_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=42),
    )
    try:
        assert list(live_timeouts().values()) == [("gloo", 42.0)]
        with caplog.at_level(logging.WARNING, logger="trainguard.collectives"):
            session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
        (finding,) = session.timeout_warnings
        assert "42 s" in finding
        assert any(finding in r.getMessage() for r in caplog.records)
    finally:
        collectives.uninstrument()
        dist.destroy_process_group()
