from __future__ import annotations

from collections.abc import Iterator

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
