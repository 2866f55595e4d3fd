from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.daemon import Agent
from tests.agents.agents_testkit import FakeController, quiet_agent_settings


@pytest.fixture
def agents_controller() -> Iterator[FakeController]:
    controller = FakeController()
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: a Unix socket's path is limited to 107
    bytes (``sun_path``), and pytest's ``tmp_path`` can be longer."""
    with tempfile.TemporaryDirectory(prefix="tga-") as d:
        yield Path(d)


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Any]:
    """In-process agents on :func:`quiet_agent_settings` (no controller: its URL refuses),
    built by ``make(**overrides)`` and taken down after the test."""
    agents: list[Agent] = []

    def make(**kw: Any) -> Agent:
        extra = {"dev_dir": tmp_path / "no-dev", **kw}
        agent = Agent(quiet_agent_settings(tmp_path, "http://127.0.0.1:9", **extra))
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.batch.close()
        agent.reporter.stop()
        agent.sampler.close()
        agent.backend.shutdown()
