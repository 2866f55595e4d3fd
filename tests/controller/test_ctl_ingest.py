"""Ingest end to end: a real controller on SQLite and PostgreSQL, reports over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests import http_calls


def test_report_is_stored_and_visible(live_controller, ctl_report, ctl_metric) -> None:
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        r = client.post(
            "/api/v1/reports",
            json=ctl_report("node-a", 0),
            headers=live_controller.headers("agent"),
        )
        assert r.status_code == 200, r.text
        assert r.json()["seq"] == 0 and r.json()["duplicate"] is False

        nodes = client.get("/api/v1/nodes", headers=live_controller.headers("viewer")).json()
        assert nodes["count"] == 1
        node = nodes["data"][0]
        assert node["name"] == "node-a" and node["health"] == "healthy"
        assert node["gpu_count"] == 8 and node["power_w"] == 2600.0

        detail = client.get("/api/v1/nodes/node-a", headers=live_controller.headers("viewer"))
        body = detail.json()
        assert [g["index"] for g in body["gpus"]] == list(range(8))
        assert body["gpus"][3]["latest"]["power_w"] == 303.0
        # One downsampled row per GPU for the report window of 5 samples.
        assert len(body["history"]) == 8
        point = next(p for p in body["history"] if p["gpu_index"] == 2)
        assert point["samples"] == 5 and point["power_w_avg"] == 302.0
        assert point["end_unix_s"] - point["start_unix_s"] == 4.0

        status = client.get("/api/v1/status", headers=live_controller.headers("viewer")).json()
        assert status["reports_total"] == 1 and status["gpus_total"] == 8
        assert status["database"] in ("sqlite", "postgresql")


def test_retried_report_is_not_counted_twice(live_controller, ctl_report, ctl_metric) -> None:
    agent = live_controller.headers("agent")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        first = ctl_report("node-b", 7)
        assert (
            client.post("/api/v1/reports", json=first, headers=agent).json()["duplicate"] is False
        )
        again = client.post("/api/v1/reports", json=first, headers=agent).json()
        assert again == {**again, "seq": 7, "duplicate": True, "commands": []}
        older = client.post("/api/v1/reports", json=ctl_report("node-b", 3), headers=agent).json()
        assert older["duplicate"] is True
        # A new agent instance (wiped spool) restarts at seq 0 and is accepted.
        fresh = ctl_report("node-b", 0, instance="inst-2")
        assert (
            client.post("/api/v1/reports", json=fresh, headers=agent).json()["duplicate"] is False
        )
        # seq 9 after 7: one report never arrived.
        client.post("/api/v1/reports", json=ctl_report("node-b", 9), headers=agent)
        metrics = client.get("/metrics").text
        detail = client.get("/api/v1/nodes/node-b", headers=live_controller.headers())

    assert ctl_metric(metrics, "trainguard_ingest_reports_total") == 3
    assert ctl_metric(metrics, "trainguard_ingest_duplicate_reports_total") == 2
    assert ctl_metric(metrics, "trainguard_ingest_gpu_samples_total") == 3 * 5 * 8
    assert ctl_metric(metrics, "trainguard_ingest_seq_gaps_total") == 1
    assert len(detail.json()["history"]) == 3 * 8


def test_concurrent_reports_share_transactions(controller_factory, ctl_report, ctl_metric) -> None:
    live = controller_factory(ingest_flush_interval_s=0.2)
    n = 24

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            warm = ctl_report("warm", 0)
            await client.post("/api/v1/reports", json=warm, headers=live.headers("agent"))
            before = live.controller.store.commits
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/api/v1/reports",
                        json=ctl_report(f"node-{i:02d}", 0),
                        headers=live.headers("agent"),
                    )
                    for i in range(n)
                )
            )
            live.commits_delta = live.controller.store.commits - before  # type: ignore[attr-defined]
            return replies

    replies = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in replies)
    assert live.commits_delta < n / 2, live.commits_delta  # type: ignore[attr-defined]
    metrics = http_calls.get(f"{live.url}/metrics").text
    assert ctl_metric(metrics, "trainguard_ingest_gpu_samples_total") == (n + 1) * 40


def test_acknowledged_reports_survive_a_restart(live_controller, ctl_report, ctl_metric) -> None:
    agent = live_controller.headers("agent")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        for seq in range(3):
            assert client.post("/api/v1/reports", json=ctl_report("node-c", seq), headers=agent)
    live_controller.restart()
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        # The dedupe cursor came back from the database.
        again = client.post("/api/v1/reports", json=ctl_report("node-c", 2), headers=agent)
        assert again.json()["duplicate"] is True
        detail = client.get("/api/v1/nodes/node-c", headers=live_controller.headers()).json()
    assert len(detail["history"]) == 3 * 8
    assert detail["health"] == "healthy" and len(detail["gpus"]) == 8


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_observers_see_each_stored_report_once(live_controller, ctl_report) -> None:
    """The event detectors subscribe to: ``NodeReported`` once per durable report, never for
    a duplicate, seen before the reply, and a failing subscriber does not fail the report."""
    from controller.services.events import NodeReported

    seen: list[tuple[str, int]] = []

    async def record(event: NodeReported) -> None:
        seen.append((event.report.node.name, event.report.seq))

    async def broken(event: NodeReported) -> None:
        raise RuntimeError("detector bug")

    events = live_controller.controller.events
    events.subscribe(NodeReported, broken, name="test-broken")
    events.subscribe(NodeReported, record, name="test-recorder")
    agent = live_controller.headers("agent")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        for seq in (0, 1, 1):
            r = client.post("/api/v1/reports", json=ctl_report("node-o", seq), headers=agent)
            assert r.status_code == 200
    assert seen == [("node-o", 0), ("node-o", 1)]
