"""A job's own policy applied by the engine (issue 18), its dry-run plan approved by a human,
and the ``webhook`` step against a real HTTP receiver.

Real controller, real HTTP, real database (as test_engine.py); the job's policy comes from
the actuator (``Actuator.job_policy``: on Kubernetes the workload's ``trainguard.io/policy``
annotation, parsed by ``k8s.workloads.job_policy`` and tested with the fake API server in
tests/actuators), here a :class:`RecordingActuator` that answers it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controller.actuators.base import ActuatorError, JobPolicy
from controller.services.remediation.approval import ApprovalError
from controller.services.webhook import verify
from tests.remediation.test_engine import (
    Agents,
    actions,
    on_loop,
    open_incident,
    recording,
    remediation_over,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

SECRET = "webhook-secret-0123456789"


def start(controller_factory: Any, **settings: Any) -> tuple[Any, Any]:
    live = controller_factory(**settings)
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    return live, actuator


def fault_on_n1(live: Any) -> int:
    return open_incident(live, "gpu_fault", node="n1", severity="critical")


def rows(live: Any, incident: int) -> list[tuple[str, str]]:
    return [
        (a["kind"], a["status"]) for a in actions(live) if a["trigger"] == f"incident:{incident}"
    ]


def acted(actuator: Any) -> list[str]:
    return [m for m, _ in actuator.calls if m in ("isolate_node", "restart_job", "stop_job")]


def test_job_steps_replace_the_rules_steps(controller_factory: Any) -> None:
    live, actuator = start(controller_factory)
    actuator.policies["gpt"] = JobPolicy(steps=("isolate",))
    incident = fault_on_n1(live)
    wait_for(lambda: ("isolate_node", "succeeded") in rows(live, incident))
    remediation_over(live, incident)
    # The rule for a fatal GPU fault checkpoints, isolates and restarts; this job said isolate.
    assert rows(live, incident) == [("isolate_node", "succeeded")]
    assert acted(actuator) == ["isolate_node"]


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        (JobPolicy(steps=("isolate", "reboot")), "unknown step(s) ['reboot']"),
        (ActuatorError("trainguard.io/policy on js: not JSON (x)"), "not JSON (x)"),
    ],
)
def test_bad_job_policy_acts_on_nothing_and_says_why(
    controller_factory: Any, policy: Any, says: str
) -> None:
    live, actuator = start(controller_factory)
    actuator.policies["gpt"] = policy
    incident = fault_on_n1(live)
    skip = wait_for(lambda: [a for a in actions(live) if a["kind"] == "skip"])[0]
    assert skip["status"] == "skipped" and says in skip["outcome"]
    assert "not acting on it until that is fixed" in skip["outcome"]
    remediation_over(live, incident)
    assert rows(live, incident) == [("skip", "skipped")]
    assert acted(actuator) == []


def test_dry_run_plan_waits_for_approval_then_runs_once(controller_factory: Any) -> None:
    live, actuator = start(controller_factory)
    actuator.policies["gpt"] = JobPolicy(dry_run=True)
    incident = fault_on_n1(live)
    plan = wait_for(lambda: [a for a in actions(live) if a["kind"] == "approval"])[0]
    assert plan["status"] == "dry_run" and plan["params"]["awaiting_approval"] is True
    assert plan["params"]["planned_steps"] == ["checkpoint", "isolate", "restart"]
    assert "awaiting approval" in plan["outcome"]
    assert ("isolate_node", "dry_run") in rows(live, incident)
    assert ("restart_job", "dry_run") in rows(live, incident)
    assert acted(actuator) == []  # nothing done before a human says so

    engine = live.controller.remediation
    with pytest.raises(ApprovalError, match="not a plan awaiting approval"):
        on_loop(live, engine.approve(plan["id"] - 1, "alice"))
    with pytest.raises(ApprovalError, match="needs the approver"):
        on_loop(live, engine.approve(plan["id"], " "))
    started = on_loop(live, engine.approve(plan["id"], "alice"))
    assert started["approved_by"] == "alice" and not started["dry_run"]
    wait_for(lambda: ("restart_job", "succeeded") in rows(live, incident))
    assert acted(actuator) == ["isolate_node", "restart_job"]
    approved = next(a for a in actions(live) if a["id"] == plan["id"])
    assert approved["status"] == "succeeded" and approved["outcome"] == "approved by alice"
    assert approved["params"]["approved_by"] == "alice"
    assert approved["params"]["awaiting_approval"] is False
    # Once: a second approval is refused, and so is one of an unknown action.
    with pytest.raises(ApprovalError, match="already approved by alice"):
        on_loop(live, engine.approve(plan["id"], "bob"))
    with pytest.raises(ApprovalError, match="not found") as missing:
        on_loop(live, engine.approve(10**9, "bob"))
    assert missing.value.status == 404
    assert acted(actuator) == ["isolate_node", "restart_job"]


class Receiver:
    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.seen: list[tuple[dict[str, Any], bool]] = []


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = dict(self.headers.items())
            rec.seen.append((json.loads(body), verify(SECRET.encode(), headers, body)))
            status = rec.statuses.pop(0) if rec.statuses else 200
            answer = json.dumps({"ticket": "OPS-7"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield rec, f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def test_webhook_step_posts_a_signed_payload_and_retries(
    controller_factory: Any, receiver: tuple[Receiver, str]
) -> None:
    rec, url = receiver
    rec.statuses = [503]  # the first attempt fails: retried with backoff
    live, actuator = start(
        controller_factory,
        remediation_webhook_url=url,
        remediation_webhook_secret=SECRET,
        remediation_webhook_timeout_s=2.0,
    )
    actuator.policies["gpt"] = JobPolicy(steps=("webhook", "isolate"))
    incident = fault_on_n1(live)
    wait_for(lambda: ("isolate_node", "succeeded") in rows(live, incident), timeout_s=10)
    assert rows(live, incident) == [("webhook", "succeeded"), ("isolate_node", "succeeded")]
    hook = next(a for a in actions(live) if a["kind"] == "webhook")
    assert hook["params"]["url"] == url
    assert "answered HTTP 200 (2 attempt(s)" in hook["outcome"] and "OPS-7" in hook["outcome"]
    assert len(rec.seen) == 2 and all(ok for _, ok in rec.seen)  # both signed, same delivery
    assert rec.seen[0][0]["delivery"] == rec.seen[1][0]["delivery"]
    event = rec.seen[1][0]
    assert event["event"] == "remediation"
    assert event["payload"]["incident"]["id"] == incident
    assert event["payload"]["incident"]["kind"] == "gpu_fault"
    assert event["payload"]["remediation"]["job"] == "gpt"
    assert event["payload"]["remediation"]["steps"] == ["webhook", "isolate"]


def test_webhook_failure_is_recorded_and_the_next_steps_run(
    controller_factory: Any, receiver: tuple[Receiver, str]
) -> None:
    rec, url = receiver
    rec.statuses = [400]  # a refusal is final: not retried
    live, actuator = start(
        controller_factory, remediation_webhook_url=url, remediation_webhook_secret=SECRET
    )
    actuator.policies["gpt"] = JobPolicy(steps=("webhook", "isolate"))
    incident = fault_on_n1(live)
    wait_for(lambda: ("isolate_node", "succeeded") in rows(live, incident), timeout_s=10)
    hook = next(a for a in actions(live) if a["kind"] == "webhook")
    assert hook["status"] == "failed" and "HTTP 400" in hook["outcome"]
    assert len(rec.seen) == 1


def test_webhook_url_needs_a_secret(db_url: str) -> None:  # (the module's parametrization)
    from controller.settings import ControllerSettings

    with pytest.raises(ValueError, match="needs remediation_webhook_secret"):
        ControllerSettings(dev_mode=True, remediation_webhook_url="http://127.0.0.1:1/x")


def test_restart_when_the_placement_cannot_be_read_fails_with_the_reason(
    controller_factory: Any,
) -> None:
    live, actuator = start(controller_factory)

    async def unreadable(job: str) -> Any:
        raise ActuatorError("pod llm-0 of job 'gpt' has no trainguard.io/rank=<n> label")

    actuator.current_placement = unreadable
    incident = fault_on_n1(live)
    row = wait_for(lambda: [a for a in actions(live) if a["kind"] == "restart_job"])[0]
    assert row["status"] == "failed" and row["trigger"] == f"incident:{incident}"
    assert row["outcome"].startswith("cannot tell where job gpt runs: pod llm-0")
    remediation_over(live, incident)  # the row is written before the remediation ends
    remediation = live.controller.remediation.snapshot()["remediations"][0]
    assert remediation["state"] == "failed"
