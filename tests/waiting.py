"""Polling for tests that wait on another process, thread or event loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout_s: float = 15.0, *, interval_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy and return that, or fail the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval_s)
