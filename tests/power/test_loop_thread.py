"""The controller's power tick runs off the event loop, so a big tree cannot stall requests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any
from unittest.mock import AsyncMock, MagicMock

from controller.services.power.loop import PowerLoop
from controller.state import ClusterState
from power.domains import parse_domains
from power.policy import PowerPolicy, TickResult


def test_tick_runs_in_a_worker_thread_and_views_read_a_snapshot() -> None:
    incidents = AsyncMock()
    incidents.find_open = MagicMock(return_value=None)
    loop = PowerLoop(ClusterState(), AsyncMock(), incidents, AsyncMock())
    loop.set_tree(
        parse_domains(
            {
                "name": "row-a",
                "kind": "row",
                "budget_w": 1000,
                "children": [{"name": "n1", "kind": "server", "budget_w": 600}],
            }
        )
    )
    policy = loop.policy
    assert policy is not None
    policy.latencies_s.extend([0.5, 1.5])
    threads: list[int] = []
    real = PowerPolicy.tick

    def tick(*args: Any) -> TickResult:
        threads.append(threading.get_ident())
        return real(policy, *args)

    policy.tick = tick  # type: ignore[method-assign,assignment]

    async def run() -> int:
        await loop.tick(100.0)
        return threading.get_ident()

    event_loop_thread = asyncio.run(run())
    assert len(threads) == 1 and threads[0] != event_loop_thread
    assert loop.last_tick_unix_s == 100.0 and set(loop.last) == {"row-a", "n1"}
    assert loop.latencies_s == (0.5, 1.5)
