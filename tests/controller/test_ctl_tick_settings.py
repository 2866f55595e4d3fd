"""The detectors' and the remediation engine's pace as settings (issue 13): production
defaults equal the constructors' own, each setting reaches its component through the
composition root, and values that would stop a loop or make it spin are refused."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from pydantic import ValidationError

from controller.logic.detection.c4d import C4DConfig
from controller.services.detection import degraded as degraded_detection
from controller.services.detection.jobs import JobDetector
from controller.services.remediation import grow
from controller.services.remediation.engine import RemediationEngine
from controller.settings import ControllerSettings

TICK_SETTINGS = (
    "remediation_tick_interval_s",
    "remediation_grow_check_interval_s",
    "job_tick_interval_s",
    "degraded_bump_interval_s",
    "degraded_tick_interval_s",
)


def _default(cls: type, parameter: str) -> Any:
    return inspect.signature(cls).parameters[parameter].default


def test_defaults_are_the_components_own() -> None:
    s = ControllerSettings(dev_mode=True)
    assert s.remediation_tick_interval_s == _default(RemediationEngine, "tick_interval_s") == 1.0
    assert s.remediation_grow_check_interval_s == grow.GROW_CHECK_INTERVAL_S == 5.0
    assert s.job_tick_interval_s == _default(JobDetector, "tick_interval_s") == 1.0
    assert s.degraded_bump_interval_s == degraded_detection.BUMP_INTERVAL_S == 2.0
    detector = degraded_detection.DegradedGpuDetector
    assert s.degraded_tick_interval_s == _default(detector, "tick_interval_s") == 1.0
    assert s.c4d_confirm_min_s == C4DConfig().confirm_min_s == 5.0


@pytest.mark.parametrize("name", TICK_SETTINGS)
@pytest.mark.parametrize("value", [0, -1.0, 1e9])
def test_intervals_must_be_positive_and_bounded(name: str, value: float) -> None:
    with pytest.raises(ValidationError, match=name):
        ControllerSettings.model_validate({"dev_mode": True, name: value})


def test_confirm_min_s_may_be_zero_but_not_negative() -> None:
    assert ControllerSettings(dev_mode=True, c4d_confirm_min_s=0).c4d_confirm_min_s == 0
    with pytest.raises(ValidationError, match="c4d_confirm_min_s"):
        ControllerSettings(dev_mode=True, c4d_confirm_min_s=-1)


def test_environment_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_REMEDIATION_TICK_INTERVAL_S", "0.25")
    monkeypatch.setenv("TRAINGUARD_C4D_CONFIRM_MIN_S", "1.5")
    s = ControllerSettings(dev_mode=True)
    assert (s.remediation_tick_interval_s, s.c4d_confirm_min_s) == (0.25, 1.5)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_settings_reach_the_components(controller_factory: Any) -> None:
    live = controller_factory(
        remediation_tick_interval_s=0.3,
        remediation_grow_check_interval_s=0.7,
        job_tick_interval_s=0.4,
        degraded_bump_interval_s=0.6,
        c4d_confirm_min_s=1.5,
    )
    tickers = {type(t).__name__: t for t in live.controller.tickers}
    engine = live.controller.remediation
    assert tickers["RemediationEngine"] is engine and engine.tick_interval_s == 0.3
    assert engine._grow.check_interval_s == 0.7
    jobs = tickers["JobDetector"]
    assert jobs.tick_interval_s == 0.4 and jobs.trackers.cfg.confirm_min_s == 1.5
    assert jobs.trackers.cfg.hang_timeout_s == C4DConfig().hang_timeout_s  # the rest as before
    assert tickers["DegradedGpuDetector"].bump_interval_s == 0.6


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_degraded_tick_setting_paces_its_loop(controller_factory: Any) -> None:
    # 20 ticks at 0.05 s come well within 10 s; at the 1 s default they could not.
    live = controller_factory(degraded_tick_interval_s=0.05)
    detector = {type(t).__name__: t for t in live.controller.tickers}["DegradedGpuDetector"]
    assert detector.tick_interval_s == 0.05
    live.wait_ticks("DegradedGpuDetector", 20, timeout_s=10.0)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_degraded_detector_refuses_a_tick_that_would_spin(value: float) -> None:
    with pytest.raises(ValueError, match="tick_interval_s"):
        degraded_detection.DegradedGpuDetector(None, None, tick_interval_s=value)  # type: ignore[arg-type]
