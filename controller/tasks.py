"""Stopping the controller's background tasks, for sure.

Python 3.11's ``asyncio.wait_for`` returns its inner call's result instead of raising when
a cancellation arrives just as that call completes (gh-86296, fixed in 3.12). A periodic
task cancelled at that instant swallows the cancellation and sleeps on into its next round,
and whoever awaited it after one ``cancel()`` waits as long as the loop runs: seen here as
a controller taking 30 s and more to stop, its leader-election task cancelled inside the
lock check's ``wait_for`` (about 1 stop in 20 under load, PostgreSQL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

#: How long a cancelled task gets before it is cancelled again.
CANCEL_RETRY_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and return once every one is done, cancelling again those that
    swallowed the cancellation. Their exceptions are retrieved (not raised): a task that
    failed has logged its own error, and stopping must not stop halfway."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()


__all__ = ["CANCEL_RETRY_S", "cancel_and_wait"]
