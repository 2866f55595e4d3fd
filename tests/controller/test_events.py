"""The event bus: typed delivery in order, bounded waiting, and a slow consumer that can
neither stall the publisher nor grow memory without bound. Pure asyncio, no I/O."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from controller.services.events import EventBus, IncidentOpened, JobRecordsReported, NodeReported
from trainguard import wire


def report(seq: int) -> wire.Report:
    return wire.Report.model_validate(
        {
            "node": {"name": "node-a", "hostname": "node-a", "backend": "sim"},
            "agent_instance": "a1",
            "seq": seq,
            "sent_unix_s": 1.0,
            "sample_interval_s": 1.0,
            "samples": [],
        }
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_each_subscriber_gets_its_type_in_order_and_survives_its_own_errors() -> None:
    async def main() -> tuple[list[int], list[int], list[str]]:
        bus = EventBus()
        seen: list[int] = []
        failing: list[int] = []
        other: list[str] = []

        async def record(event: NodeReported) -> None:
            seen.append(event.report.seq)

        async def broken(event: NodeReported) -> None:
            failing.append(event.report.seq)
            raise RuntimeError("consumer bug")

        async def jobs(event: JobRecordsReported) -> None:
            other.append(event.node)

        bus.subscribe(NodeReported, record, name="record")
        bus.subscribe(NodeReported, broken, name="broken")
        bus.subscribe(JobRecordsReported, jobs, name="jobs")
        for seq in range(5):
            await bus.deliver(NodeReported(report(seq), 1.0))
        await bus.stop()
        return seen, failing, other

    seen, failing, other = run(main())
    assert seen == [0, 1, 2, 3, 4]  # each seen before deliver returned, in order
    assert failing == [0, 1, 2, 3, 4]  # an exception does not end the subscription
    assert other == []  # a subscriber gets only its own event type


def test_a_slow_consumer_delays_the_publisher_once_then_not_at_all() -> None:
    async def main() -> tuple[list[float], list[int], int]:
        bus = EventBus(wait_s=0.2)
        release = asyncio.Event()
        fast: list[int] = []

        async def stuck(event: NodeReported) -> None:
            await release.wait()

        async def quick(event: NodeReported) -> None:
            fast.append(event.report.seq)

        sub = bus.subscribe(NodeReported, stuck, name="stuck")
        bus.subscribe(NodeReported, quick, name="quick")
        waits = []
        for seq in range(4):
            started = time.monotonic()
            await bus.deliver(NodeReported(report(seq), 1.0))
            waits.append(time.monotonic() - started)
        backlog = sub.backlog
        release.set()
        await asyncio.sleep(0)
        await bus.stop()
        return waits, fast, backlog

    waits, fast, backlog = run(main())
    assert 0.15 < waits[0] < 1.0  # the first delivery waited for the (stuck) consumer, bounded
    assert all(w < 0.1 for w in waits[1:])  # it was behind: not waited for again
    assert fast == [0, 1, 2, 3]  # the other consumer kept up, each before its reply
    assert backlog == 3  # the stuck consumer's events wait in its own queue


def test_a_full_queue_drops_new_events_for_that_subscriber_only() -> None:
    async def main() -> tuple[int, int, list[int], list[int]]:
        bus = EventBus(queue_size=2, wait_s=0.01)
        release = asyncio.Event()
        slow_seen: list[int] = []
        fast_seen: list[int] = []

        async def slow(event: NodeReported) -> None:
            await release.wait()
            slow_seen.append(event.report.seq)

        async def fast(event: NodeReported) -> None:
            fast_seen.append(event.report.seq)

        sub = bus.subscribe(NodeReported, slow, name="slow")
        bus.subscribe(NodeReported, fast, name="fast")
        for seq in range(10):
            bus.publish(NodeReported(report(seq), 1.0))
            await asyncio.sleep(0)  # let the consumers run, as between two requests
        dropped = sub.dropped
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        delivered = sub.delivered
        await bus.stop()
        return dropped, delivered, slow_seen, fast_seen

    dropped, delivered, slow_seen, fast_seen = run(main())
    # slow took event 0 and blocks in it; 1 and 2 fill its queue; 3..9 are dropped for it.
    assert dropped == 7
    assert slow_seen == [0, 1, 2] and delivered == 3
    assert fast_seen == list(range(10))  # the other subscriber lost nothing


def test_stop_discards_what_is_queued_and_ignores_events_until_started() -> None:
    async def main() -> list[int]:
        bus = EventBus()
        seen: list[int] = []
        gate = asyncio.Event()

        async def consumer(event: IncidentOpened | NodeReported) -> None:
            assert isinstance(event, NodeReported)
            await gate.wait()
            seen.append(event.report.seq)

        bus.subscribe(NodeReported, consumer, name="c")
        bus.publish(NodeReported(report(1), 1.0))
        bus.publish(NodeReported(report(2), 1.0))
        await asyncio.sleep(0)
        await bus.stop()  # 1 was being handled (cancelled), 2 was queued (discarded)
        gate.set()
        await bus.deliver(NodeReported(report(3), 1.0))  # stopped: ignored
        bus.start()
        await bus.deliver(NodeReported(report(4), 1.0))
        await bus.stop()
        return seen

    assert run(main()) == [4]


def test_a_queue_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        EventBus(queue_size=0)
