"""The composition root hands every rank event to the actuator (issue 18: placement from
the ranks), through the real event bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.runtime import compose
from controller.services.events import JobRecordsReported
from controller.settings import ControllerSettings
from tests.remediation.recording import RecordingActuator
from trainguard import wire


def test_rank_events_reach_the_actuator(tmp_path: Path) -> None:
    tokens = [{"name": "ops", "role": "operator", "token": "o" * 20}]
    settings = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'tg.db'}", tokens=tokens)

    async def noop(*_: object) -> None:
        return None

    async def scenario() -> list[tuple[str, object]]:
        services = compose(settings, on_elected=noop, on_lost=noop, acting=lambda: False)
        actuator = RecordingActuator(placements={}, pools={})
        services.remediation.actuator = actuator
        services.events.start()
        try:
            event = wire.RankEvent(job="llm", rank=0, kind="started", time_unix_s=1.0,
                                   world_size=2, pod="llm-w-0-0-a", namespace="train")  # fmt: skip
            report = wire.Report.model_validate(
                {
                    "node": {"name": "gpu-a"},
                    "agent_instance": "a1",
                    "seq": 1,
                    "sent_unix_s": 1.0,
                    "job": {"rank_events": [event.model_dump()]},
                }
            )
            await services.events.deliver(JobRecordsReported(report, 1.0))
        finally:
            await services.events.stop()
        return actuator.calls

    assert ("observe_ranks", "gpu-a") in asyncio.run(scenario())


def test_detections_reach_the_platform_only_from_the_leader(tmp_path: Path) -> None:
    """compose() subscribes DetectionEvents: a new incident becomes a platform Event through
    the actuator, on the leader; a standby records nothing (issue 18)."""
    from controller.services.events import IncidentOpened
    from controller.state import IncidentState

    tokens = [{"name": "ops", "role": "operator", "token": "o" * 20}]
    settings = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'tg.db'}", tokens=tokens)
    leading = {"now": False}

    async def noop(*_: object) -> None:
        return None

    incident = IncidentState(
        id=7, kind="xid_fatal", severity="critical", state="open", summary="XID 79",
        dedupe_key="k", opened_unix_s=1.0, updated_unix_s=1.0, node="gpu-a",
    )  # fmt: skip

    async def scenario() -> list[tuple[str, object]]:
        services = compose(settings, on_elected=noop, on_lost=noop, acting=lambda: leading["now"])
        actuator = RecordingActuator(placements={}, pools={})
        services.remediation.actuator = actuator
        services.events.start()
        try:
            await services.events.deliver(IncidentOpened(incident))
            leading["now"] = True
            await services.events.deliver(IncidentOpened(incident))
        finally:
            await services.events.stop()
        return actuator.calls

    calls = asyncio.run(scenario())
    assert calls.count(("record_event", "TrainguardXidFatal")) == 1


def test_the_detector_knows_the_power_limits_trainguard_sent(tmp_path: Path) -> None:
    """A straggler held at the limit trainguard's own power policy sent is no hardware
    fault (controller/logic/detection/cause.py): compose() hands the detector the power
    loop's record of the limits it sent. Without the wiring the detector saw every
    ``sw_power_cap`` as someone else's cap (hardware evidence: isolate, restart)."""
    from controller.logic.detection.cause import OwnCap
    from power import Decision, Knob, Level

    tokens = [{"name": "ops", "role": "operator", "token": "o" * 20}]
    settings = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'tg.db'}", tokens=tokens)

    async def noop(*_: object) -> None:
        return None

    services = compose(settings, on_elected=noop, on_lost=noop, acting=lambda: False)
    assert services.jobs.own_caps is not None
    assert services.jobs.own_caps("gpu-a", 1) == OwnCap(limit_w=None)
    tracker = services.power.loop.tracker
    decision = Decision(node="gpu-a", gpu_index=1, command=wire.SetPowerLimit(id="c1", gpu_index=1,
                        limit_w=250.0), knob=Knob.POWER_LIMIT, domain=None, level=Level(1),
                        threshold_frac=None, domain_power_w=None, budget_w=None,
                        reason="test")  # fmt: skip
    tracker.publish(tracker.plan(decision, None, 1.0), action_id=1, command_id="c1")
    assert services.jobs.own_caps("gpu-a", 1) == OwnCap(limit_w=250.0)
    assert services.jobs.own_caps("gpu-a", 0) == OwnCap(limit_w=None)
