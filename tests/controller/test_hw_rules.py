"""The hardware rule table (pure) and the health detector acting on it (real HTTP API)."""

from __future__ import annotations

import time
from typing import Any

from controller.logic.detection.hw_rules import RULES, HwRules
from trainguard import wire


def _report(seq: int, gpus: list[dict[str, Any]], events: list[dict[str, Any]] | None = None,
            gpu_error: str = "") -> wire.Report:  # fmt: skip
    return wire.Report.model_validate(
        {
            "node": {"name": "n1", "gpu_error": gpu_error},
            "agent_instance": "i",
            "seq": seq,
            "sent_unix_s": 10.0 + seq,
            "samples": [{"time_unix_s": 10.0 + seq, "gpus": gpus, "events": events or []}],
        }
    )


def test_every_rule_has_a_level_and_a_meaning() -> None:
    assert {level for level, _ in RULES.values()} == {"fatal", "degrade", "count"}
    assert all(meaning for _, meaning in RULES.values())


def test_standing_conditions_are_found_once_and_again_after_clearing() -> None:
    rules = HwRules()
    bad = {"index": 2, "row_remap_pending": True, "nvlinks": [{"link": 4, "active": False}]}
    first = rules.findings(_report(0, [bad]))
    assert [(f.signal, f.level, f.gpu_index) for f in first] == [
        ("row_remap_pending", "degrade", 2),
        ("nvlink_down", "degrade", 2),
    ]
    assert first[1].reason == "GPU 2: NVLink 4 down"
    assert rules.findings(_report(1, [bad])) == []  # still pending: not found again
    healed = {"index": 2, "row_remap_pending": False, "nvlinks": [{"link": 4, "active": True}]}
    rules.findings(_report(2, [healed]))
    assert [f.signal for f in rules.findings(_report(3, [bad]))] == [
        "row_remap_pending",
        "nvlink_down",
    ]


def test_levels_of_gpu_node_and_nic_signals() -> None:
    rules = HwRules()
    gpus = [
        {"index": 0, "row_remap_failed": True},
        {"index": 1, "retired_pages_sbe": 50, "retired_pages_dbe": 10},
        {"index": 2, "fabric_state": "completed", "fabric_status": 999},
        {"index": 3, "unknown": True, "error": "NVML did not answer within 1 s"},
        {"index": 4, "fabric_state": "in_progress", "ecc_corrected_total": 10**6,
         "pcie_replay_total": 500, "throttle_reasons_mask": 0x40},
    ]  # fmt: skip
    events = [
        {"kind": "nic_gone", "time_unix_s": 10.0, "device": "mlx5_1"},
        {"kind": "nic_errors_rising", "time_unix_s": 10.0, "device": "mlx5_0",
         "counter": "symbol_error", "delta": 12},
        {"kind": "nvlink_up", "time_unix_s": 10.0, "gpu_index": 0},
    ]  # fmt: skip
    found = rules.findings(_report(0, gpus, events, gpu_error="NVML failed (Driver Not Loaded)"))
    got = {(f.signal, f.level, f.gpu_index, f.device) for f in found}
    assert got == {
        ("gpu_watch_failed", "fatal", None, ""),
        ("row_remap_failed", "fatal", 0, ""),
        ("retired_pages_limit", "fatal", 1, ""),
        ("fabric_failed", "fatal", 2, ""),
        ("gpu_unknown", "degrade", 3, ""),
        ("fabric_not_ready", "degrade", 4, ""),
        ("nic_gone", "degrade", None, "mlx5_1"),
        ("nic_errors_rising", "count", None, "mlx5_0"),
    }  # corrected ECC, replays and throttling only count: no finding


def test_detector_classifies_through_the_api(live_controller, ctl_report) -> None:  # type: ignore[no-untyped-def]
    # A node whose NVML is broken: unhealthy with the agent's text, until NVML works again.
    broken = ctl_report("gpu-broken", 0, gpus=0, samples=1)
    broken["node"]["backend"] = "nvml"
    broken["node"]["gpu_error"] = "NVML failed (Driver Not Loaded) although NVIDIA devices exist"
    live_controller.report(broken)
    node = live_controller.read("/api/v1/nodes/gpu-broken")
    assert node["health"] == "unhealthy"
    assert node["health_reason"].startswith("GPUs not watched: NVML failed (Driver Not Loaded)")
    kinds = {i["kind"] for i in live_controller.read("/api/v1/incidents", state="open")["data"]}
    assert kinds == {"gpu_watch_failed"}
    fixed = ctl_report("gpu-broken", 1, gpus=0, samples=1)
    fixed["node"]["backend"] = "nvml"
    live_controller.report(fixed)
    assert live_controller.read("/api/v1/nodes/gpu-broken")["health"] == "healthy"

    # A failed row remap is fatal for that GPU; a downed NVLink only degrades another.
    t0 = time.time()
    overrides = {
        1: {"row_remap_failed": True},
        5: {"nvlinks": [{"link": 0, "active": True}, {"link": 7, "active": False}]},
    }
    live_controller.report(ctl_report("gpu-node", 0, gpu_overrides=overrides, t0=t0))
    node = live_controller.read("/api/v1/nodes/gpu-node")
    assert node["health"] == "unhealthy" and node["gpus_unhealthy"] == 1
    assert node["gpus"][1]["health_reason"] == "GPU 1: row remapping failed"
    assert node["gpus"][5]["health"] == "healthy"
    incidents = live_controller.read("/api/v1/incidents", state="open", node="gpu-node")["data"]
    by_kind = {(i["kind"], i["gpu_index"]): i for i in incidents}
    assert set(by_kind) == {("gpu_fault", 1), ("hw_degraded", 5)}
    assert by_kind[("hw_degraded", 5)]["severity"] == "warning"
    assert by_kind[("hw_degraded", 5)]["summary"] == "gpu-node: GPU 5: NVLink 7 down"
