"""A GPU's ``hw_degraded`` warning resolves itself once its standing conditions clear: the
pure clearing rule with plain wire objects, then the detector through the real HTTP API
(flaps, an unknown GPU, and a controller restart on the same database)."""

from __future__ import annotations

from typing import Any

from controller.logic.detection.hw_clearing import (
    CLEAR_AFTER_REPORTS,
    HwClearing,
    gpu_verdict,
    incident_signals,
)
from controller.logic.detection.incident_evidence import (
    EvidenceEvent,
    HwEvidence,
    UntypedEvidence,
)
from trainguard import wire

DOWN = {"nvlinks": [{"link": 7, "active": False}], "nvlink_active_count": 17}
#: Healthy links are left out of the wire; the count says every link's state was read.
UP = {"nvlink_active_count": 18}
UNKNOWN = {"unknown": True, "error": "nvmlDeviceGetPowerUsage did not answer in 1 s"}


def _gpu(index: int = 3, **fields: Any) -> wire.GpuSample:
    return wire.GpuSample.model_validate({"index": index, **fields})


def _report(seq: int, *samples: dict[str, Any], node: str = "n1") -> wire.Report:
    """A report of one sample per dict (each GPU 3's fields); GPU 0 is always healthy."""
    return wire.Report.model_validate(
        {
            "node": {"name": node},
            "agent_instance": "i",
            "seq": seq,
            "sent_unix_s": 10.0 + seq,
            "samples": [
                {"time_unix_s": 10.0 + seq + k / 10, "gpus": [{"index": 0}, {"index": 3, **g}]}
                for k, g in enumerate(samples)
            ],
        }
    )


def test_a_sample_shows_a_signal_cleared_only_when_it_was_read() -> None:
    nvlink = {"nvlink_down"}
    assert gpu_verdict(_gpu(**DOWN), nvlink) == "standing"
    assert gpu_verdict(_gpu(**UP), nvlink) == "clear"
    # A link whose state NVML did not answer is left out too: absent is not "up".
    assert gpu_verdict(_gpu(), nvlink) == "unread"
    # Unknown: gpu_unknown stands and nothing else was read; lost / unreachable read nothing.
    assert gpu_verdict(_gpu(**UNKNOWN, **UP), nvlink) == "standing"
    assert gpu_verdict(_gpu(lost=True, **UP), nvlink) == "unread"
    assert gpu_verdict(_gpu(unreachable=True, **UP), nvlink) == "unread"
    # An unknown GPU that answers again clears gpu_unknown.
    assert gpu_verdict(_gpu(), {"gpu_unknown"}) == "clear"
    # Any other degrade condition standing keeps the warning, recorded or not.
    assert gpu_verdict(_gpu(row_remap_pending=True, **UP), nvlink) == "standing"
    assert gpu_verdict(_gpu(fabric_state="in_progress", **UP), nvlink) == "standing"
    remap = {"row_remap_pending"}
    assert gpu_verdict(_gpu(row_remap_pending=None), remap) == "unread"
    assert gpu_verdict(_gpu(row_remap_pending=False), remap) == "clear"
    assert gpu_verdict(_gpu(fabric_state="completed", fabric_status=0), {"fabric_not_ready"}) == (
        "clear"
    )


def test_the_warning_clears_after_the_required_clear_reports_with_a_note() -> None:
    assert CLEAR_AFTER_REPORTS == 3
    clearing = HwClearing()
    signals = {3: {"nvlink_down"}}
    assert clearing.observe(_report(0, DOWN), signals) == []
    assert clearing.observe(_report(1, UP), signals) == []
    assert clearing.observe(_report(2, UP), signals) == []
    [cleared] = clearing.observe(_report(3, UP), signals)
    assert (cleared.node, cleared.gpu_index) == ("n1", 3)
    assert cleared.note == "NVLink 7 up again; no degraded condition stands on GPU 3 for 3 reports"
    # Said again on every clear report until the warning is gone (a refused write retries).
    assert [c.gpu_index for c in clearing.observe(_report(4, UP), signals)] == [3]
    # Resolved: nothing open, nothing tracked.
    assert clearing.observe(_report(5, UP), {}) == []
    assert clearing.observe(_report(6, UP), signals) == []  # a new warning counts from zero


def test_a_flap_or_an_unread_gpu_restarts_the_count_and_a_missing_one_holds_it() -> None:
    clearing = HwClearing()
    signals = {3: {"nvlink_down"}}
    clearing.observe(_report(0, DOWN), signals)
    clearing.observe(_report(1, UP), signals)
    clearing.observe(_report(2, UP), signals)
    assert clearing.observe(_report(3, DOWN), signals) == []  # flapped: from zero
    clearing.observe(_report(4, UP), signals)
    clearing.observe(_report(5, UP), signals)
    # Down in one sample of the report, up in its last: the report is not clear.
    assert clearing.observe(_report(6, UP, DOWN, UP), signals) == []
    clearing.observe(_report(7, UP), signals)
    clearing.observe(_report(8, UP), signals)
    # Unknown, lost or unreachable say nothing of the link: never clear, count restarts.
    for seq, unread in enumerate((UNKNOWN, {"lost": True}, {"unreachable": True}), 9):
        assert clearing.observe(_report(seq, unread), signals) == []
    clearing.observe(_report(12, UP), signals)
    clearing.observe(_report(13, UP), signals)
    # A report without samples, or without the GPU, tells nothing: the count holds.
    empty = wire.Report.model_validate(
        {"node": {"name": "n1"}, "agent_instance": "i", "seq": 14, "sent_unix_s": 24.0}
    )
    assert clearing.observe(empty, signals) == []
    assert [c.gpu_index for c in clearing.observe(_report(15, UP), signals)] == [3]


def test_without_a_memo_the_open_warning_and_the_samples_decide() -> None:
    """A new leader: memory empty, the warning loaded from the database."""
    clearing = HwClearing()
    signals = {3: {"nvlink_down", "gpu_unknown"}}
    for seq in range(CLEAR_AFTER_REPORTS - 1):
        assert clearing.observe(_report(seq, UP), signals) == []
    [cleared] = clearing.observe(_report(9, UP), signals)
    assert cleared.note == (
        "NVML answers again; NVLinks up again; no degraded condition stands on GPU 3 for 3 reports"
    )


def test_edge_event_warnings_and_untyped_evidence_are_left_alone() -> None:
    clearing = HwClearing()
    # PCIe degradation comes as an event: no sample says it is over.
    signals = {3: {"nvlink_down", "pcie_link_degraded"}}
    for seq in range(2 * CLEAR_AFTER_REPORTS):
        assert clearing.observe(_report(seq, UP), signals) == []
    evidence = HwEvidence(
        signal="nvlink_down",
        events=[EvidenceEvent(time_unix_s=1.0, signal="pcie_link_degraded")],
    )
    assert incident_signals(evidence) == {"nvlink_down", "pcie_link_degraded"}
    assert incident_signals(HwEvidence(signal="row_remap_pending")) == {"row_remap_pending"}
    assert incident_signals(UntypedEvidence.of({"signal": "nvlink_down"})) is None


# ------------------------------------------------------------------ through the API


def _hw(live: Any, node: str, state: str) -> list[dict[str, Any]]:
    found = live.read("/api/v1/incidents", node=node, state=state)["data"]
    return sorted((i for i in found if i["kind"] == "hw_degraded"), key=lambda i: i["gpu_index"])


def test_nvlink_warning_resolves_when_the_link_stays_up_also_after_a_restart(
    live_controller: Any, ctl_report: Any
) -> None:
    live, name, seq = live_controller, "node-hw", 0

    def send(gpu3: dict[str, Any], gpu5: dict[str, Any]) -> None:
        nonlocal seq
        live.report(ctl_report(name, seq, samples=2, gpu_overrides={3: gpu3, 5: gpu5}))
        seq += 1

    send(DOWN, DOWN)
    opened = _hw(live, name, "open")
    assert [(i["gpu_index"], i["summary"]) for i in opened] == [
        (3, f"{name}: GPU 3: NVLink 7 down"),
        (5, f"{name}: GPU 5: NVLink 7 down"),
    ]
    # GPU 3 flaps: up for fewer reports than required, then down again: still the one warning.
    for _ in range(CLEAR_AFTER_REPORTS - 1):
        send(UP, DOWN)
    send(DOWN, DOWN)
    assert [i["id"] for i in _hw(live, name, "open")] == [i["id"] for i in opened]
    # Unknown (an NVML call hung) tells nothing of the link: never resolves it.
    for _ in range(CLEAR_AFTER_REPORTS):
        send(UNKNOWN, DOWN)
    for _ in range(CLEAR_AFTER_REPORTS - 1):
        send(UP, DOWN)
    assert [i["gpu_index"] for i in _hw(live, name, "open")] == [3, 5]
    # Up for the required reports: resolved, saying what cleared.
    send(UP, DOWN)
    assert [i["gpu_index"] for i in _hw(live, name, "open")] == [5]
    [resolved] = _hw(live, name, "resolved")
    assert resolved["id"] == opened[0]["id"]
    assert resolved["evidence"]["resolution"] == (
        "NVML answers again; NVLink 7 up again; no degraded condition stands on GPU 3 for 3 reports"
    )
    assert live.read(f"/api/v1/nodes/{name}")["gpus"][3]["health"] == "healthy"

    # A restarted controller (memory empty) still resolves the warning it loads.
    live.restart()
    for _ in range(CLEAR_AFTER_REPORTS - 1):
        send(UP, UP)
    assert [i["gpu_index"] for i in _hw(live, name, "open")] == [5]
    send(UP, UP)
    assert _hw(live, name, "open") == []
    gpu5 = next(i for i in _hw(live, name, "resolved") if i["gpu_index"] == 5)
    assert gpu5["id"] == opened[1]["id"]
    assert gpu5["evidence"]["resolution"] == (
        "NVLinks up again; no degraded condition stands on GPU 5 for 3 reports"
    )
