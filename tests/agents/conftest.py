from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.agents_testkit import FakeController


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
