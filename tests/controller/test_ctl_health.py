"""The health detector through the real HTTP API: fatal vs application XIDs, ECC, lost
GPUs, silent agents."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from typing import Any

import pytest

from controller.services.detection.health import _each
from tests import http_calls
from tests.waiting import wait_for


def _xids(code: int, n: int, t0: float) -> list[dict[str, Any]]:
    return [{"code": code, "time_unix_s": t0 + k * 0.01} for k in range(n)]


def test_fatal_xid_makes_gpu_and_node_unhealthy(live_controller, ctl_report, ctl_metric) -> None:
    t0 = time.time()
    bad = {3: {"xid_events": [{"code": 79, "time_unix_s": t0}]}}
    live_controller.report(ctl_report("node-x", 0, gpu_overrides=bad))

    node = live_controller.read("/api/v1/nodes/node-x")
    assert node["health"] == "unhealthy"
    assert node["health_reason"] == "XID 79 on GPU 3: GPU has fallen off the bus"
    assert node["gpus_unhealthy"] == 1 and node["open_incidents"] == 1
    gpu3 = node["gpus"][3]
    assert gpu3["health"] == "unhealthy" and "XID 79" in gpu3["health_reason"]
    assert all(g["health"] == "healthy" for g in node["gpus"] if g["index"] != 3)

    incidents = live_controller.read("/api/v1/incidents", state="open")
    assert incidents["count"] == 1
    incident = incidents["data"][0]
    assert (incident["kind"], incident["severity"]) == ("gpu_fault", "critical")
    assert (incident["node"], incident["gpu_index"]) == ("node-x", 3)
    # One XID per sample (5 samples in the report): folded into the same incident.
    assert incident["count"] == 5

    # More faults on the same GPU bump the open incident instead of opening another.
    live_controller.report(ctl_report("node-x", 1, gpu_overrides=bad))
    assert live_controller.read("/api/v1/incidents")["count"] == 1
    assert live_controller.read(f"/api/v1/incidents/{incident['id']}")["count"] == 10

    metrics = http_calls.get(f"{live_controller.url}/metrics").text
    assert 'trainguard_incidents_open{kind="gpu_fault"} 1.0' in metrics
    assert 'trainguard_nodes{health="unhealthy"} 1.0' in metrics

    # An operator resolves the fault: the GPU is trusted again.
    r = http_calls.post(
        f"{live_controller.url}/api/v1/incidents/{incident['id']}/resolve",
        headers=live_controller.headers("operator"),
    )
    assert r.status_code == 200 and r.json()["state"] == "resolved"
    node = live_controller.read("/api/v1/nodes/node-x")
    assert node["health"] == "healthy" and node["gpus_unhealthy"] == 0


def test_application_xid_storm_is_one_record_and_harmless(live_controller, ctl_report) -> None:
    t0 = time.time()
    for seq in range(3):
        storm = {2: {"xid_events": _xids(45, 40, t0 + seq)}}
        live_controller.report(ctl_report("node-s", seq, samples=1, gpu_overrides=storm))

    node = live_controller.read("/api/v1/nodes/node-s")
    assert node["health"] == "healthy" and node["gpus_unhealthy"] == 0
    incidents = live_controller.read("/api/v1/incidents")
    assert incidents["count"] == 1
    record = incidents["data"][0]
    assert (record["kind"], record["severity"], record["gpu_index"]) == (
        "application_xid",
        "info",
        2,
    )
    assert record["count"] == 120
    assert record["evidence"]["codes"] == {"45": 120}
    assert live_controller.read("/api/v1/status")["gpus_unhealthy"] == 0


def test_uncorrectable_ecc_growth_is_a_fault(live_controller, ctl_report) -> None:
    live_controller.report(ctl_report("node-e", 0, samples=1))
    # Corrected errors are not faults.
    corrected = {1: {"ecc_corrected_total": 500}}
    live_controller.report(ctl_report("node-e", 1, samples=1, gpu_overrides=corrected))
    assert live_controller.read("/api/v1/nodes/node-e")["health"] == "healthy"

    grown = {1: {"ecc_uncorrected_total": 2}}
    live_controller.report(ctl_report("node-e", 2, samples=1, gpu_overrides=grown))
    node = live_controller.read("/api/v1/nodes/node-e")
    assert node["health"] == "unhealthy"
    assert node["gpus"][1]["health_reason"] == "uncorrectable ECC errors on GPU 1: 0 -> 2"
    incident = live_controller.read("/api/v1/incidents", kind="gpu_fault")["data"][0]
    assert incident["gpu_index"] == 1


def test_ecc_baseline_survives_restart(live_controller, ctl_report) -> None:
    base = {0: {"ecc_uncorrected_total": 4}}
    live_controller.report(ctl_report("node-r", 0, samples=1, gpu_overrides=base))
    live_controller.restart()
    grown = {0: {"ecc_uncorrected_total": 5}}
    live_controller.report(ctl_report("node-r", 1, samples=1, gpu_overrides=grown))
    assert live_controller.read("/api/v1/nodes/node-r")["gpus"][0]["health"] == "unhealthy"


def test_lost_gpu_sample_is_a_fault(live_controller, ctl_report) -> None:
    lost = {5: {"lost": True, "power_w": None}}
    live_controller.report(ctl_report("node-l", 0, gpu_overrides=lost))
    node = live_controller.read("/api/v1/nodes/node-l")
    assert node["health"] == "unhealthy"
    assert node["gpus"][5]["health"] == "lost"
    assert node["gpus"][5]["health_reason"].startswith("GPU 5 lost")
    incidents = live_controller.read("/api/v1/incidents", node="node-l")
    assert [i["kind"] for i in incidents["data"]] == ["gpu_fault"]


def test_silent_agent_marks_node_lost_and_back(controller_factory, ctl_report) -> None:
    # Wide enough that a report and the read right after it never straddle the threshold on
    # a loaded 2-core CI machine (a 0.6 s threshold flaked there), short enough to wait out.
    live = controller_factory(node_lost_after_s=2.0)
    live.report(ctl_report("node-q", 0, samples=1))
    fault = {6: {"xid_events": [{"code": 48, "time_unix_s": time.time()}]}}
    live.report(ctl_report("node-f", 0, samples=1, gpu_overrides=fault))

    wait_for(lambda: live.read("/api/v1/nodes/node-q")["health"] == "lost")
    node = live.read("/api/v1/nodes/node-q")
    assert node["health_reason"].startswith("no report for")
    lost = live.read("/api/v1/incidents", kind="node_lost", node="node-q", state="open")
    assert lost["count"] == 1 and lost["data"][0]["severity"] == "critical"
    wait_for(lambda: live.read("/api/v1/nodes/node-f")["health"] == "lost")

    # Each node is read right after its own report, before it can fall silent again.
    live.report(ctl_report("node-q", 1, samples=1))
    assert live.read("/api/v1/nodes/node-q")["health"] == "healthy"
    live.report(ctl_report("node-f", 1, samples=1))
    # The GPU fault outlives the outage.
    back = live.read("/api/v1/nodes/node-f")
    assert back["health"] == "unhealthy" and "XID 48" in back["health_reason"]
    resolved = live.read("/api/v1/incidents", kind="node_lost", node="node-q", state="resolved")
    assert resolved["count"] == 1
    assert resolved["data"][0]["resolved_unix_s"] is not None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_node_lost_survives_a_failing_tick(controller_factory, ctl_report) -> None:
    live = controller_factory(node_lost_after_s=0.3)
    incidents = live.controller.incidents
    real = incidents.open_or_bump
    calls = {"n": 0}

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("database hiccup")
        return await real(*args, **kwargs)

    incidents.open_or_bump = flaky
    live.report(ctl_report("node-t", 0, samples=1))
    wait_for(lambda: live.read("/api/v1/incidents", kind="node_lost")["count"] == 1)
    assert calls["n"] >= 2
    assert live.read("/api/v1/nodes/node-t")["health"] == "lost"


def test_a_tick_cancelled_midway_leaves_no_step_unawaited_and_still_raises_failures() -> None:
    """The controller stopping cancels a health tick between two nodes' steps: the steps not
    reached are closed (no "coroutine was never awaited" at shutdown); without a cancel,
    every step runs and the first failure comes out at the end."""
    ran: list[int] = []

    async def step(i: int, *, fail: bool = False, block: bool = False) -> None:
        ran.append(i)
        if block:
            await asyncio.sleep(3600)
        if fail:
            raise RuntimeError(f"step {i}")

    async def cancelled() -> None:
        task = asyncio.create_task(_each([step(0), step(1, block=True), step(2), step(3)]))
        while ran != [0, 1]:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(cancelled())
        gc.collect()
    assert ran == [0, 1]
    assert not [w for w in caught if "never awaited" in str(w.message)]

    ran.clear()
    with pytest.raises(RuntimeError, match="step 1"):
        asyncio.run(_each([step(0), step(1, fail=True), step(2, fail=True), step(3)]))
    assert ran == [0, 1, 2, 3]
