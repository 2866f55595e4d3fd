"""A GPU the agent reports ``unreachable`` (no NVML read answered, sample after sample):
through the real HTTP API it opens one critical ``gpu_unreachable`` incident and makes the
GPU and its node unhealthy; the first report that reads it again resolves the incident and
gives the health back, unless a fault on that GPU still stands."""

from __future__ import annotations

from typing import Any

UNREACHABLE = {
    "unreachable": True,
    "error": "unreachable: no NVML read answered in 5 samples in a row; power: Unknown Error",
    **dict.fromkeys(
        ("power_w", "energy_j", "temperature_c", "sm_clock_mhz", "utilization_gpu_pct"), None
    ),
    **dict.fromkeys(("memory_used_bytes", "ecc_corrected_total", "ecc_uncorrected_total"), None),
}


def _incidents(live: Any, node: str, kind: str, state: str) -> list[dict[str, Any]]:
    found = live.read("/api/v1/incidents", node=node, state=state)["data"]
    return [i for i in found if i["kind"] == kind]


def test_unreachable_gpu_opens_an_incident_that_resolves_when_it_reads_again(
    live_controller: Any, ctl_report: Any
) -> None:
    live, name = live_controller, "node-u"
    live.report(ctl_report(name, 0))
    assert live.read(f"/api/v1/nodes/{name}")["health"] == "healthy"

    live.report(ctl_report(name, 1, gpu_overrides={2: UNREACHABLE}))
    node = live.read(f"/api/v1/nodes/{name}")
    assert node["health"] == "unhealthy"
    gpu2 = node["gpus"][2]
    assert gpu2["health"] == "unhealthy"
    assert gpu2["health_reason"].startswith("GPU 2 unreachable: ")
    assert "Unknown Error" in gpu2["health_reason"]
    [incident] = _incidents(live, name, "gpu_unreachable", "open")
    assert (incident["severity"], incident["gpu_index"]) == ("critical", 2)
    assert incident["evidence"]["gpu_error"] == UNREACHABLE["error"]

    # Still unreachable, or a tick that hung (unknown: says neither): nothing new.
    live.report(ctl_report(name, 2, gpu_overrides={2: UNREACHABLE}))
    live.report(ctl_report(name, 3, gpu_overrides={2: {"unknown": True, "power_w": None}}))
    [same] = _incidents(live, name, "gpu_unreachable", "open")
    assert same["id"] == incident["id"] and same["count"] == 1
    assert live.read(f"/api/v1/nodes/{name}")["gpus"][2]["health"] == "unhealthy"

    # The GPU reads again: resolved, GPU and node healthy.
    live.report(ctl_report(name, 4))
    assert _incidents(live, name, "gpu_unreachable", "open") == []
    [resolved] = _incidents(live, name, "gpu_unreachable", "resolved")
    assert resolved["id"] == incident["id"]
    node = live.read(f"/api/v1/nodes/{name}")
    assert node["health"] == "healthy"
    assert node["gpus"][2]["health"] == "healthy"
    assert node["gpus"][2]["health_reason"] == ""
    # No fault was opened on the way (the hung tick's own hw_degraded warning aside).
    kinds = {i["kind"] for i in live.read("/api/v1/incidents", node=name)["data"]}
    assert kinds == {"gpu_unreachable", "hw_degraded"}


def test_a_fault_on_the_gpu_outlives_its_unreachable_incident(
    live_controller: Any, ctl_report: Any
) -> None:
    """Unreachable, then lost (GPU_IS_LOST): the lost sample ends "unreachable" (it says
    something else) but the GPU stays out for the fault, which only a human resolves."""
    live, name = live_controller, "node-v"
    live.report(ctl_report(name, 0, gpu_overrides={4: UNREACHABLE}))
    assert len(_incidents(live, name, "gpu_unreachable", "open")) == 1

    live.report(ctl_report(name, 1, gpu_overrides={4: {"lost": True, "power_w": None}}))
    assert _incidents(live, name, "gpu_unreachable", "open") == []
    assert len(_incidents(live, name, "gpu_fault", "open")) == 1
    node = live.read(f"/api/v1/nodes/{name}")
    assert node["health"] == "unhealthy"
    assert node["gpus"][4]["health"] == "lost"
    assert node["gpus"][4]["health_reason"].startswith("GPU 4 lost")

    # Reads again, the fault still open: the GPU is not trusted yet.
    live.report(ctl_report(name, 2))
    assert live.read(f"/api/v1/nodes/{name}")["gpus"][4]["health"] == "lost"
