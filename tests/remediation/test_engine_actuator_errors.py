"""Actuator errors in the remediation steps: a ``retryable`` one is tried again (a bounded
number of times, with a short backoff), one that is not fails at once, and an isolation
the cluster refused still keeps trainguard's own plans off the culprit node."""

from __future__ import annotations

from typing import Any

import pytest

from controller.actuators.base import ActuatorError, ActuatorResult, Placement
from controller.services.remediation.steps import isolate as isolate_step
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import (
    ENGINE,
    Agents,
    actions,
    nodes,
    of,
    open_incident,
    policy_file,
    remediation_over,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

POLICY = (
    "rules:\n"
    "  - {kind: gpu_fault, severity: critical, steps: [isolate, restart]}\n"
    "  - {kind: '*', steps: [alert]}\n"
    "guards: {max_isolated_fraction: 0.5, settle_s: 0}\n"
)


class FlakyActuator(RecordingActuator):
    """A recording actuator whose ``restart_job`` / ``isolate_node`` raise an
    :class:`ActuatorError` (``retryable`` as set) their first ``n`` times."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        #: method -> (failures left, retryable)
        self.fail: dict[str, tuple[int, bool]] = {}
        self.tries: dict[str, int] = {}

    def _maybe_fail(self, method: str) -> None:
        self.tries[method] = self.tries.get(method, 0) + 1
        left, retryable = self.fail.get(method, (0, False))
        if left > 0:
            self.fail[method] = (left - 1, retryable)
            raise ActuatorError(f"{method} boom {self.tries[method]}", retryable=retryable)

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        self._maybe_fail("restart_job")
        return await super().restart_job(placement, reason=reason)

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        self._maybe_fail("isolate_node")
        return await super().isolate_node(node, reason=reason)


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The production pauses (1 s, 2 s) are the point of other tests' timing, not these."""
    monkeypatch.setattr(isolate_step, "ACTUATOR_BACKOFF_S", (0.05, 0.1))


def start(live: Any, fail: dict[str, tuple[int, bool]]) -> FlakyActuator:
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = FlakyActuator(
        placements={"gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=2)},
        pools={"gpt": ["n0", "n1", "n2"]},
    )
    actuator.fail = dict(fail)
    live.controller.remediation.actuator = actuator
    return actuator


def row(live: Any, incident: int, kind: str) -> dict[str, Any]:
    rows = wait_for(
        lambda: [a for a in of(live, incident) if a["kind"] == kind and a["status"] != "pending"]
    )
    assert len(rows) == 1, rows
    return rows[0]


def test_a_retryable_restart_error_is_retried_on_the_same_generation(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, short_backoff
) -> None:
    live = controller_factory(policy_file=policy_file(tmp_path, POLICY))
    actuator = start(live, {"restart_job": (2, True)})
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    restart = row(live, incident, "restart_job")
    assert restart["status"] == "succeeded", restart
    assert "(after 3 attempts)" in restart["outcome"]
    assert actuator.tries["restart_job"] == 3
    # One restart started, of the placement the plan made (the same generation each try).
    assert [(p.nodes, p.generation) for p in actuator.restarts()] == [(("n0", "n2"), 1)]


def test_a_restart_that_stays_retryable_gives_up_after_the_bounded_attempts(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, short_backoff
) -> None:
    live = controller_factory(policy_file=policy_file(tmp_path, POLICY))
    actuator = start(live, {"restart_job": (10, True)})
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    restart = row(live, incident, "restart_job")
    assert restart["status"] == "failed"
    assert restart["outcome"] == (
        "gave up after 3 attempts; last error (retryable): restart_job boom 3"
    )
    remediation_over(live, incident)
    live.wait_ticks(ENGINE)
    assert actuator.tries["restart_job"] == isolate_step.ACTUATOR_ATTEMPTS == 3
    assert actuator.restarts() == []


def test_a_restart_error_that_is_not_retryable_fails_at_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, short_backoff
) -> None:
    live = controller_factory(policy_file=policy_file(tmp_path, POLICY))
    actuator = start(live, {"restart_job": (1, False)})
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    restart = row(live, incident, "restart_job")
    assert restart["status"] == "failed"
    assert restart["outcome"] == (
        "failed on the first attempt; error not retryable: restart_job boom 1"
    )
    remediation_over(live, incident)
    live.wait_ticks(ENGINE)
    assert actuator.tries["restart_job"] == 1 and actuator.restarts() == []


def test_a_retryable_isolation_error_is_retried(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, short_backoff
) -> None:
    live = controller_factory(policy_file=policy_file(tmp_path, POLICY))
    actuator = start(live, {"isolate_node": (1, True)})
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    isolated = row(live, incident, "isolate_node")
    assert isolated["status"] == "succeeded"
    assert isolated["outcome"] == "n1 isolated (after 2 attempts)"
    assert actuator.tries["isolate_node"] == 2
    reason = nodes(live)["n1"]["isolated_reason"]
    assert reason and "cluster-side" not in reason


@pytest.mark.parametrize("retryable", [False, True], ids=["not-retryable", "retryable"])
def test_a_failed_isolation_still_keeps_trainguard_off_the_node(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, short_backoff, retryable
) -> None:
    policy = POLICY.replace("settle_s: 0", "settle_s: 0, resume_timeout_s: 1")
    # Two of four nodes may be isolated (circuit breaker) and quarantined (budget).
    live = controller_factory(
        policy_file=policy_file(tmp_path, policy), quarantine_budget_share=0.5
    )
    attempts = 3 if retryable else 1
    actuator = start(live, {"isolate_node": (attempts, retryable)})  # this isolation only
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    isolated = row(live, incident, "isolate_node")
    assert isolated["status"] == "failed"
    why = "gave up after 3 attempts; last error (retryable): isolate_node boom 3"
    if not retryable:
        why = "failed on the first attempt; error not retryable: isolate_node boom 1"
    assert isolated["outcome"] == f"{why}; n1 marked isolated in trainguard only"
    assert actuator.tries["isolate_node"] == attempts
    # trainguard's own record calls it isolated, and says the cluster did not.
    node = nodes(live)["n1"]
    assert node["isolated_unix_s"] is not None
    assert node["isolated_reason"].startswith(f"cluster-side isolation failed ({why})")
    assert f"incident {incident} (gpu_fault)" in node["isolated_reason"]
    assert live.controller.state.nodes["n1"].isolated_reason == node["isolated_reason"]
    assert row(live, incident, "restart_job")["status"] == "succeeded", of(live, incident)
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n2")]
    # No rank steps here: the restart is reported as failed to resume, and the job is free.
    wait_for(lambda: live.controller.remediation.jobs["gpt"].awaiting_resume is None)
    # A later plan (n2 fails now) may not pick n1, which still reports healthy; and the
    # circuit breaker and the quarantine budget count n1 (2 of 4: the 50 % they allow).
    second = open_incident(live, "gpu_fault", node="n2", severity="critical")
    assert row(live, second, "isolate_node")["status"] == "succeeded"
    row(live, second, "restart_job")
    assert all("n1" not in p.nodes for p in actuator.restarts()), actuator.restarts()
    third = open_incident(live, "gpu_fault", node="n3", severity="critical")
    refused = row(live, third, "isolate_node")
    assert refused["status"] == "skipped" and "circuit breaker open" in refused["outcome"]
    assert nodes(live)["n3"]["isolated_reason"] is None
    assert all(a["status"] != "pending" for a in actions(live))
