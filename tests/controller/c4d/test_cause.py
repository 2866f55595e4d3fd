"""Annotating a straggler with the cause its GPU's telemetry shows."""

from __future__ import annotations

from controller.logic.detection.cause import straggler_cause
from trainguard.wire import GpuSample, ThrottleReason


def gpu(**kw: object) -> GpuSample:
    return GpuSample.model_validate({"index": 0, "sm_clock_mhz": 1980, **kw})


def test_healthy_gpu_has_no_cause() -> None:
    causes, facts = straggler_cause(gpu(), [gpu(), gpu()])
    assert causes == [] and facts["peer_sm_clock_mhz"] == 1980


def test_thermal_power_lock_low_clock_and_ecc_are_each_named() -> None:
    hot = gpu(
        temperature_c=92.4, throttle_reasons=[ThrottleReason.HW_THERMAL_SLOWDOWN], sm_clock_mhz=1300
    )
    assert straggler_cause(hot, [gpu(), gpu()])[0] == [
        "thermal throttling at 92 °C",
        "SM clock 1300 MHz vs 1980 MHz on peers",
    ]
    capped = gpu(
        throttle_reasons=[ThrottleReason.SW_POWER_CAP], locked_sm_clock_mhz=1275, sm_clock_mhz=1275
    )
    causes, facts = straggler_cause(capped, [gpu()])
    # The clock lock is trainguard's own (the agent reports only its own): not a cause
    # (tests/remediation/test_own_cap_not_hardware.py), but said in the facts.
    assert causes == ["power throttling or capping"]
    assert facts["power_policy"] == "SM clock locked at 1275 MHz by trainguard's power policy"
    flaky = gpu(ecc_corrected_total=5000)
    assert straggler_cause(flaky, [gpu(ecc_corrected_total=3)])[0] == [
        "5000 correctable ECC errors (peers ≤ 3)"
    ]


def test_no_telemetry_no_cause() -> None:
    assert straggler_cause(None, [gpu()]) == ([], {})


def test_the_gpu_is_compared_with_its_peer_groups_gpus_not_the_whole_jobs() -> None:
    """Stage 1 (ranks 4-7) runs every GPU at 1500 MHz; stage 0 at 1980 MHz. Rank 5's clock
    is what its peers run at, so a low clock is not its cause."""
    from controller.logic.detection.c4d import Finding, FindingKind
    from controller.logic.detection.c4d.evidence import PeerGroupEvidence
    from controller.logic.detection.c4d.job_evidence import JobEvidence, StragglerIncidentEvidence
    from controller.logic.detection.c4d.peers import PeerBasis
    from controller.services.detection.jobs import JobDetector
    from controller.state import ClusterState, GpuState, NodeState

    state = ClusterState()
    for node, clock in (("n0", 1980), ("n1", 1500)):
        state.nodes[node] = NodeState(name=node, first_seen_unix_s=0.0)
        for i in range(4):
            state.nodes[node].gpus[i] = GpuState(index=i, latest=gpu(index=i, sm_clock_mhz=clock))
    detector = JobDetector(state, None, None)  # type: ignore[arg-type]
    tracker = detector.trackers.tracker("j")
    for rank in range(8):
        tracker.rank_node[rank] = f"n{rank // 4}"
        tracker.rank_gpu[rank] = rank % 4

    def finding(evidence: JobEvidence) -> Finding:
        return Finding(
            kind=FindingKind.STRAGGLER,
            job="j",
            severity="warning",
            summary="",
            key="k",
            ranks=(5,),
            evidence=evidence,
        )

    # Only the peer group matters here: a partial straggler evidence (built unvalidated).
    group = PeerGroupEvidence(label="g", basis=PeerBasis.JOB, role=None, ranks=[4, 5, 6, 7], why="")
    causes, facts = detector._gpu_cause(
        finding(StragglerIncidentEvidence.model_construct(peer_group=group))
    )
    assert causes == [] and facts["peer_sm_clock_mhz"] == 1500
    causes, _ = detector._gpu_cause(finding(JobEvidence()))  # no peer group known: the whole job
    assert causes == ["SM clock 1500 MHz vs 1980 MHz on peers"]
