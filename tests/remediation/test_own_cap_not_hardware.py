"""trainguard's own power cap is not hardware evidence, and one node is isolated once.

Found by the remediation acceptance probe (second round): F1, a straggler slowed by the
power policy's own clock lock or power limit was read as hardware evidence, so the default
straggler rule isolated its node; F5, two jobs on one node both isolated it (two actions,
two actuator calls), as the "already isolated" check lost the race.
"""

from __future__ import annotations

from typing import Any

import pytest

from controller.logic.detection.c4d.job_evidence import GpuCauseFacts
from controller.logic.detection.cause import POLICY_FACT, SHARED_FACT, OwnCap, straggler_cause
from tests.remediation.recording import GatedIsolation
from tests.remediation.test_engine import (
    ENGINE,
    Agents,
    actions,
    live_test,
    of,
    open_incident,
    policy_file,
    recording,
    remediation_over,
    straggler_evidence,
    two_jobs_on_n1,
)
from tests.waiting import wait_for
from trainguard.wire import GpuSample
from trainguard.wire import ThrottleReason as T


def gpu(index: int, **kw: Any) -> GpuSample:
    return GpuSample(index=index, uuid=f"g{index}", **kw)


PEERS = [gpu(0, sm_clock_mhz=1400, power_limit_w=700.0), gpu(2, sm_clock_mhz=1410)]


def test_own_clock_lock_is_not_a_cause() -> None:
    causes, facts = straggler_cause(gpu(1, sm_clock_mhz=1000, locked_sm_clock_mhz=1000), PEERS)
    assert causes == []
    assert facts[POLICY_FACT] == "SM clock locked at 1000 MHz by trainguard's power policy"


def test_own_power_limit_is_not_a_cause_and_explains_the_low_clock() -> None:
    capped = gpu(1, sm_clock_mhz=900, power_limit_w=250.0, throttle_reasons=[T.SW_POWER_CAP])
    causes, facts = straggler_cause(capped, PEERS, OwnCap(limit_w=250.0))
    assert causes == []
    assert facts[POLICY_FACT] == "capped by trainguard's power policy (250 W)"


def test_a_cap_every_peer_shares_is_not_a_cause() -> None:
    peers = [gpu(i, sm_clock_mhz=1000, throttle_reasons=[T.SW_POWER_CAP]) for i in (0, 2)]
    capped = gpu(1, sm_clock_mhz=1000, throttle_reasons=[T.SW_POWER_CAP])
    causes, facts = straggler_cause(capped, peers)
    assert causes == [] and facts[SHARED_FACT] == "power capped, as every peer is"


@pytest.mark.parametrize(
    ("sample", "own", "cause"),
    [
        (
            gpu(1, sm_clock_mhz=1400, power_limit_w=300.0, throttle_reasons=[T.SW_POWER_CAP]),
            OwnCap(limit_w=500.0),
            "power capped at 300 W, a cap trainguard's power policy did not set",
        ),
        (
            gpu(1, sm_clock_mhz=1400, throttle_reasons=[T.HW_SLOWDOWN]),
            None,
            "hardware slowdown or power brake",
        ),
        (
            gpu(1, sm_clock_mhz=1400, temperature_c=91, throttle_reasons=[T.HW_THERMAL_SLOWDOWN]),
            None,
            "thermal throttling at 91 °C",
        ),
    ],
    ids=["someone-elses-cap", "hw-slowdown", "thermal"],
)
def test_other_caps_and_hardware_slowdowns_stay_causes(
    sample: GpuSample, own: OwnCap | None, cause: str
) -> None:
    causes, facts = straggler_cause(sample, PEERS, own)
    assert causes == [cause] and POLICY_FACT not in facts


POLICY = (
    "rules:\n"
    "  - {kind: straggler, steps: [alert, checkpoint, isolate, restart], after_s: 1,\n"
    "     min_cost_pct: 10, isolate_when: hardware_or_repeat}\n"
    "  - {kind: '*', steps: [alert]}\n"
    "guards: {checkpoint_timeout_s: 1, max_isolated_fraction: 0.5}\n"
)


#: The same without the restart, so the second straggler of n1 is acted on (a repeat
#: offence) rather than absorbed as a consequence of the first one's restart.
REPEAT_POLICY = POLICY.replace(", restart]", "]")


def capped_straggler(sample: GpuSample, own: OwnCap | None = None) -> Any:
    """The evidence the job detector stores for a straggler on ``sample``'s GPU."""
    causes, facts = straggler_cause(sample, PEERS, own)
    return straggler_evidence(25.0).model_copy(
        update={"causes": causes, "gpu": GpuCauseFacts.model_validate(facts)}
    )


def isolate_rows(live: Any, incident: int) -> list[dict[str, Any]]:
    return [a for a in of(live, incident) if a["kind"] == "isolate_node"]


@live_test
@pytest.mark.parametrize(
    "evidence",
    [
        lambda: capped_straggler(gpu(1, sm_clock_mhz=1000, locked_sm_clock_mhz=1000)),
        lambda: capped_straggler(
            gpu(1, sm_clock_mhz=900, power_limit_w=250.0, throttle_reasons=[T.SW_POWER_CAP]),
            OwnCap(limit_w=250.0),
        ),
        # Recorded before own caps were told apart: a lock is ours all the same.
        lambda: straggler_evidence(25.0).model_copy(
            update={"causes": ["SM clock locked at 1000 MHz"]}
        ),
    ],
    ids=["clock-lock", "power-limit", "legacy-lock-cause"],
)
def test_a_straggler_under_our_own_cap_is_not_isolated_even_when_it_repeats(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, evidence
) -> None:
    live = controller_factory(
        policy_file=policy_file(tmp_path, REPEAT_POLICY), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    for _ in range(2):  # the second is a repeat offence of n1: still our own cap
        incident = open_incident(live, "straggler", node="n1", evidence=evidence())
        remediation_over(live, incident)
        rows = isolate_rows(live, incident)
        assert [r["status"] for r in rows] == ["skipped"], rows
        assert "slowed by trainguard's own power cap" in rows[0]["outcome"]
        assert "not a hardware fault" in rows[0]["outcome"]
    assert [a for a in actuator.acts() if a[0] == "isolate_node"] == []


@live_test
def test_the_default_straggler_rule_does_not_isolate_for_our_clock_lock(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    """The probe's repro: the default rule's shape (checkpoint, isolate, restart)."""
    live = controller_factory(
        policy_file=policy_file(tmp_path, POLICY), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    evidence = capped_straggler(gpu(1, sm_clock_mhz=1000, locked_sm_clock_mhz=1000))
    incident = open_incident(live, "straggler", node="n1", evidence=evidence)
    remediation_over(live, incident)
    assert [r["status"] for r in isolate_rows(live, incident)] == ["skipped"]
    assert [a for a in actuator.acts() if a[0] == "isolate_node"] == []
    # Nor restarted in place: a restart cannot lift trainguard's own cap.
    assert actuator.restarts() == []
    restarts = [a for a in of(live, incident) if a["kind"] == "restart_job"]
    assert [r["status"] for r in restarts] == ["skipped"], restarts
    assert "a restart would not lift it" in restarts[0]["outcome"]


@live_test
def test_a_cap_trainguard_did_not_set_is_hardware_evidence(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(
        policy_file=policy_file(tmp_path, POLICY), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    sample = gpu(1, sm_clock_mhz=900, power_limit_w=300.0, throttle_reasons=[T.SW_POWER_CAP])
    incident = open_incident(
        live, "straggler", node="n1", evidence=capped_straggler(sample, OwnCap(limit_w=500.0))
    )
    remediation_over(live, incident)
    assert [r["status"] for r in isolate_rows(live, incident)] == ["succeeded"]
    assert ("isolate_node", "n1") in actuator.acts()


@live_test
def test_two_jobs_on_one_node_isolate_it_once(controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    live, agents, actuator = two_jobs_on_n1(controller_factory, tmp_path, "isolate", GatedIsolation)
    assert isinstance(actuator, GatedIsolation)
    agents.report("n1", xid=79)
    engine = live.controller.remediation

    def both_running() -> list[Any]:
        rems = [r for r in engine.remediations if r.node == "n1" and r.state == "running"]
        return rems if {r.job for r in rems} == {"ja", "jb"} else []

    incident = wait_for(both_running)[0].incident_id
    wait_for(lambda: actuator.acts())  # one is inside the actuator's isolate call
    live.wait_ticks(ENGINE, 2)  # the other has reached its isolate step meanwhile
    assert actuator.acts() == [("isolate_node", "n1")]
    actuator.gate.set()
    remediation_over(live, incident)
    rows = sorted((a["status"], a["outcome"]) for a in actions(live) if a["kind"] == "isolate_node")
    assert rows == [("succeeded", "n1 is already isolated"), ("succeeded", "n1 isolated")]
    assert actuator.acts() == [("isolate_node", "n1")]
