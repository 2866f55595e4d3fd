"""The dashboard's server side without sockets: the change feed's deltas and resync, the
bounded step and power stores, and GPU history bucketing (SQLite in memory)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from controller.db.models import Base, GpuHistory, Node
from controller.services.dashboard import (
    QUEUE_MAX,
    RESYNC,
    DashboardFeed,
    GoodputHistory,
    PowerHistory,
    StepRecorder,
)
from controller.services.dashboard_reads import node_history
from controller.state import ClusterState, NodeState
from trainguard import wire

NOW = 2000.0


def _step(job: str, rank: int, step: int, t: float, world: int = 4) -> wire.StepSummary:
    return wire.StepSummary(
        job=job,
        rank=rank,
        world_size=world,
        step=step,
        step_time_s=t,
        compute_time_s=t,
        collective_wait_s=0.0,
        end_unix_s=1000.0 + step,
    )


def test_step_recorder_keeps_a_rank_by_step_matrix_within_its_bounds() -> None:
    rec = StepRecorder(steps_kept=5, jobs_kept=2)
    for step in range(1, 9):
        for rank in range(4):
            rec.record(_step("a", rank, step, 0.5 if rank != 3 else 1.0), 0.0)
    m = rec.matrix("a", last=100, now=NOW)
    assert m is not None
    assert m["steps"] == [4, 5, 6, 7, 8]  # only the newest five kept
    assert [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3]
    assert m["ranks"][3]["step_time_s"] == [1.0] * 5
    assert m["median_s"] == [0.5] * 5 and m["max_s"] == [1.0] * 5
    assert m["end_unix_s"] == [1004.0, 1005.0, 1006.0, 1007.0, 1008.0]
    assert rec.matrix("a", last=2, now=NOW)["steps"] == [7, 8]  # type: ignore[index]
    # A step still arriving (fewer ranks than the fullest) is left out for SETTLE_S; after
    # that it shows with its gaps (a rank that stopped reporting).
    rec.record(_step("a", 0, 9, 0.5), 0.0)  # ends at 1009
    assert rec.matrix("a", 100, now=1010.0)["steps"][-1] == 8  # type: ignore[index]
    assert rec.matrix("a", 100, now=1013.0)["steps"][-1] == 9  # type: ignore[index]
    for rank in (1, 2, 3):
        rec.record(_step("a", rank, 9, 0.5), 0.0)
    assert rec.matrix("a", 100, now=1010.0)["steps"][-1] == 9  # type: ignore[index]
    # A third job evicts the least recently reporting one.
    rec.record(_step("b", 0, 1, 0.1), 0.0)
    rec.record(_step("c", 0, 1, 0.1), 0.0)
    assert rec.matrix("a", 10, NOW) is None and set(rec.jobs) == {"b", "c"}


def test_step_recorder_keeps_fewer_steps_of_a_very_wide_job() -> None:
    rec = StepRecorder(steps_kept=240)
    rec.max_cells = 1000
    for step in range(50):
        rec.record(_step("wide", 0, step, 0.1, world=100), 0.0)
    assert len(rec.jobs["wide"].steps) == 10  # 1000 cells / 100 ranks


def test_power_history_samples_at_most_every_interval_and_is_bounded() -> None:
    domains = [SimpleNamespace(name="dc", power_w=900.0), SimpleNamespace(name="row", power_w=None)]
    power = SimpleNamespace(view=lambda: SimpleNamespace(enabled=True, data=domains))
    hist = PowerHistory(every_s=5.0, kept=3)
    for t in (0.0, 1.0, 5.0, 10.0, 15.0, 20.0):
        hist.maybe_sample(power, t)
    out = hist.series(since=0.0)
    assert out["domains"]["dc"] == {"t": [10.0, 15.0, 20.0], "power_w": [900.0] * 3}
    assert out["domains"]["row"]["power_w"] == [None] * 3


class _NoDb:
    async def read(self, fn: Any) -> Any:
        return ((None, None), None)


def _node(name: str, **kw: Any) -> NodeState:
    node = NodeState(name=name, hostname=name, first_seen_unix_s=0.0, **kw)
    node.health = "healthy"
    node.last_report_unix_s = 1e12  # never silent in these tests
    return node


def _messages(queue: asyncio.Queue[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    while not queue.empty():
        raw = queue.get_nowait()
        if raw == RESYNC:
            out.append(("resync", {}))
            continue
        head, data = raw.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_feed_sends_only_changed_nodes_and_resyncs_a_subscriber_that_fell_behind() -> None:
    async def run() -> None:
        state = ClusterState()
        for name in ("n1", "n2"):
            state.nodes[name] = _node(name)
        feed = DashboardFeed(state, _NoDb(), None)
        sub = feed.subscribe()
        snapshot = json.loads(feed.snapshot().decode().split("data: ", 1)[1])
        assert snapshot["full"] and [n["n"] for n in snapshot["data"]] == ["n1", "n2"]

        await feed.tick()
        assert _messages(sub.queue) == []  # nothing changed
        state.nodes["n2"].health = "unhealthy"
        state.nodes["n2"].health_reason = "XID 79"
        await feed.tick()
        [(kind, msg)] = _messages(sub.queue)
        assert kind == "nodes" and not msg.get("full")
        assert [(n["n"], n["h"], n["r"]) for n in msg["data"]] == [("n2", "unhealthy", "XID 79")]

        # A subscriber whose queue is full gets one resync marker instead of stale deltas.
        for i in range(QUEUE_MAX + 5):
            state.nodes["n1"].health_reason = f"r{i}"
            await feed.tick()
        queued = _messages(sub.queue)
        assert queued[0] == ("resync", {})
        # The 64 deltas queued and the one that did not fit were dropped; the 4 sent after
        # the overflow follow the marker.
        assert [k for k, _ in queued[1:]] == ["nodes"] * 4
        assert sub.dropped == 1 and sub.missed == QUEUE_MAX + 1
        # The stream answers the marker with a snapshot that says how much was missed.
        resync = json.loads(feed.resync(sub).decode().split("data: ", 1)[1])
        assert resync["full"] and resync["missed"] == QUEUE_MAX + 1
        assert sub.missed == 0
        assert "missed" not in json.loads(feed.snapshot().decode().split("data: ", 1)[1])
        feed.unsubscribe(sub)
        assert feed.subscribers == set()

    asyncio.run(run())


def test_feed_marks_a_quiet_node_unreachable_after_a_third_of_the_lost_timeout() -> None:
    async def run() -> None:
        state = ClusterState()
        state.nodes["n1"] = _node("n1")
        feed = DashboardFeed(state, _NoDb(), None, node_lost_after_s=30.0)
        assert feed.silent_after_s == 10.0
        sub = feed.subscribe()
        import time

        state.nodes["n1"].last_report_unix_s = time.time() - 11
        await feed.tick()
        [(_, msg)] = _messages(sub.queue)
        assert msg["data"][0]["silent"] is True
        feed.unsubscribe(sub)

    asyncio.run(run())


def test_node_history_buckets_per_gpu_on_one_axis_with_gaps_as_null() -> None:
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        s.add(Node(name="n1", hostname="n1", first_seen_unix_s=0.0))
        s.flush()
        for t, gpu, watts, temp, mask in (
            (101.0, 0, 100.0, 50.0, 0b101),
            (102.0, 0, 200.0, 70.0, 0),
            (104.0, 1, 300.0, 60.0, 0),
            (108.0, 0, 400.0, 55.0, 0),
        ):
            s.add(
                GpuHistory(
                    node_name="n1",
                    gpu_index=gpu,
                    start_unix_s=t - 1,
                    end_unix_s=t,
                    samples=1,
                    power_w_avg=watts,
                    power_w_max=watts,
                    temperature_c_max=temp,
                    sm_clock_mhz_avg=1800.0,
                    utilization_gpu_pct_avg=90.0,
                    ecc_corrected_total=1,
                    ecc_uncorrected_total=0,
                    throttle_reasons_mask=mask,
                )
            )
        s.commit()
        out = node_history(s, "n1", since_unix_s=0.0, until_unix_s=110.0, points=3)
    # Buckets sized to the data (101..110, at most 3 buckets -> 5 s), from the first with data.
    assert out["bucket_s"] == 5.0
    assert out["t"] == [105.0, 110.0, 115.0]
    gpu0, gpu1 = out["gpus"]
    assert gpu0["power_w"] == [150.0, 400.0, None]  # averaged; an empty bucket is a gap
    assert gpu0["temperature_c"] == [70.0, 55.0, None]  # maxima
    assert gpu0["throttle_reasons"] == [1.0, 0.0, None]  # reasons active, averaged: (2 + 0) / 2
    assert gpu1["power_w"] == [300.0, None, None]


def test_goodput_history_samples_each_job_at_most_every_interval() -> None:
    values = {"a": 0.9, "b": None}
    hist = GoodputHistory(every_s=5.0, kept=2, jobs_kept=1)
    for t in (0.0, 2.0, 5.0, 10.0):
        hist.maybe_sample("a", values.get, t)
        hist.maybe_sample("b", values.get, t)  # no ledger yet: nothing kept
    assert hist.series("a") == {"t": [5.0, 10.0], "ettr": [0.9, 0.9]}
    assert hist.series("b") == {"t": [], "ettr": []}
