"""The job-side client against a real Unix-socket server speaking the agent's framing."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from collectives.client import AgentClient
from collectives.config import InstrumentConfig
from collectives.outbox import Outbox
from trainguard.wire import (
    Command,
    JobCheckpoint,
    LocalHello,
    RankEvent,
    SetPowerLimit,
    StepSummary,
)


def _client(path: str, got: list[Command], **cfg: Any) -> tuple[AgentClient, Outbox]:
    config = InstrumentConfig(
        job="j", agent_socket=path, ship_interval_s=0.05, connect_backoff_max_s=0.2, **cfg
    )
    box = Outbox(1000)
    hello = LocalHello(job="j", rank=3, world_size=4, pid=1234, local_rank=3)
    return AgentClient(config, hello, box, got.extend), box


def _step(i: int) -> StepSummary:
    return StepSummary(
        job="j",
        rank=3,
        world_size=4,
        step=i,
        step_time_s=0.2,
        compute_time_s=0.15,
        collective_wait_s=0.05,
    )


def test_hello_then_batches_and_commands_come_back(collectives_agent: Any) -> None:
    agent = collectives_agent
    agent.commands = [
        (-1, JobCheckpoint(id="c1", job="j", at_step=5)),
        (1, SetPowerLimit(id="p1", gpu_index=0, limit_w=300)),
    ]
    got: list[Command] = []
    client, box = _client(agent.path, got)
    client.start()
    try:
        box.add_event(RankEvent(job="j", rank=3, kind="started", time_unix_s=1.0))
        box.add_step(_step(0))
        box.add_step(_step(1))
        assert agent.wait_for(lambda: len(agent.steps()) == 2, 10)
        assert agent.wait_for(lambda: len(got) == 2, 10)
    finally:
        client.stop()
    assert [(h.job, h.rank, h.world_size, h.pid) for h in agent.hellos] == [("j", 3, 4, 1234)]
    assert [c.id for c in got] == ["c1", "p1"]  # the client relays; Control filters kinds
    assert [e.kind for e in agent.events()] == ["started"]
    assert client.batches_sent >= 2  # empty frames keep polling for commands


def test_absent_agent_is_said_once_then_found_when_it_appears(
    short_dir: Path, caplog: pytest.LogCaptureFixture, agent_factory: Any
) -> None:
    path = str(short_dir / "late.sock")
    got: list[Command] = []
    client, box = _client(path, got)
    caplog.set_level(logging.WARNING, logger="trainguard.collectives")
    client.start()
    try:
        box.add_step(_step(0))
        deadline = time.monotonic() + 10
        while client.connect_failures < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.connect_failures >= 4
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "no node agent at" in warnings[0].getMessage()
        agent = agent_factory(path)
        assert agent.wait_for(lambda: 0 in {s for _, s in agent.steps()}, 10)
        assert client.connected
    finally:
        client.stop()
    assert box.pending() == 0


def test_a_restarted_agent_is_reconnected_and_a_wedged_one_dropped(
    short_dir: Path, agent_factory: Any
) -> None:
    path = str(short_dir / "a.sock")
    first = agent_factory(path)
    got: list[Command] = []
    client, box = _client(path, got, socket_timeout_s=0.3)
    client.start()
    try:
        box.add_step(_step(0))
        assert first.wait_for(lambda: first.steps(), 10)
        first.close()
        second = agent_factory(path)
        box.add_step(_step(1))
        assert second.wait_for(lambda: (3, 1) in second.steps(), 10)
        second.silent = True  # stops answering: the client must give up on it and retry
        box.add_step(_step(2))
        assert second.wait_for(lambda: len(second.hellos) >= 2, 10)
        second.silent = False
        box.add_step(_step(3))
        assert second.wait_for(lambda: (3, 3) in second.steps(), 10)
    finally:
        client.stop()
    second.close()
    assert client.flush(0.5) is False  # stopped and no agent: nothing blocks, nothing raises
