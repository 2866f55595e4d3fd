"""Stopping background tasks when a cancellation is swallowed (controller/tasks.py).

Python 3.11's ``asyncio.wait_for`` returns the inner result when the cancellation arrives
in the same loop iteration as that result; the tests make exactly that happen, with plain
futures (no sockets, no sleeps beyond the tasks' own).
"""

from __future__ import annotations

import asyncio
import sys

from controller.services.leader import LeaderElector
from controller.tasks import cancel_and_wait


async def _loop_around_wait_for(gate: list[asyncio.Future[None]]) -> None:
    """A periodic task shaped like the leader's: sleep, then a check under ``wait_for``."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(0.001)
        gate.append(loop.create_future())
        await asyncio.wait_for(gate[-1], 10)


def test_a_cancellation_swallowed_by_wait_for_is_cancelled_again() -> None:
    async def main() -> bool:
        gate: list[asyncio.Future[None]] = []
        task = asyncio.create_task(_loop_around_wait_for(gate))
        while not gate:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the task now waits inside wait_for
        gate[-1].set_result(None)
        task.cancel()  # same iteration: 3.11's wait_for returns instead of raising
        for _ in range(5):
            await asyncio.sleep(0)
        swallowed = not task.done()
        await asyncio.wait_for(cancel_and_wait([task]), 5)
        assert task.cancelled()
        return swallowed

    swallowed = asyncio.run(main())
    # What makes the helper needed: on 3.11 the first cancellation is lost.
    assert swallowed == (sys.version_info < (3, 12))


def test_failed_tasks_are_retrieved_not_raised() -> None:
    async def fail() -> None:
        raise RuntimeError("logged where it happened")

    async def main() -> None:
        task = asyncio.create_task(fail())
        await asyncio.sleep(0)
        await cancel_and_wait([task])
        assert isinstance(task.exception(), RuntimeError)

    asyncio.run(main())


class _RacingLock:
    """A lock whose check waits on a future the test completes while cancelling."""

    description = "test lock"

    def __init__(self) -> None:
        self.pending: asyncio.Future[None] | None = None

    async def try_acquire(self) -> bool:
        return True

    async def check(self) -> None:
        self.pending = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(self.pending, 10)

    async def release(self) -> None:
        pass


def test_stop_campaigning_returns_when_the_lock_check_swallows_the_cancellation() -> None:
    """The controller that took 30 s and more to stop: its leader task was cancelled inside
    the PostgreSQL lock check's ``wait_for`` just as the check returned, and slept on."""

    async def nothing(*_: object) -> None:
        pass

    async def main() -> None:
        lock = _RacingLock()
        elector = LeaderElector(
            lock,
            retry_interval_s=0.001,
            check_interval_s=0.001,
            on_elected=nothing,
            on_lost=nothing,
        )
        await elector.start()
        while lock.pending is None:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)
        lock.pending.set_result(None)
        # stop_campaigning cancels before it first yields: the same loop iteration.
        await asyncio.wait_for(elector.stop_campaigning(), 5)
        assert elector.is_leader  # the lock stays held until stop()

    asyncio.run(main())
