"""The remediation engine in a live controller: incidents in, recorded actions out.

Real controller, real HTTP, real database; faults arrive as agent reports (an XID 79 on a
GPU is a critical ``gpu_fault``) or, where the detector behind an incident is not the point
(stragglers, rate limits, stale evidence, grow-back), are opened through the controller's
own incident service on its event loop. Without an actuator (``actuator=none``) isolation
is still recorded and restarts are skipped with a reason; tests that restart jobs give the
engine a :class:`~tests.remediation.recording.RecordingActuator`. The local actuator with a
real job is exercised by the end-to-end recovery tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import ActuatorError, Placement
from controller.logic.detection.c4d.evidence import (
    Comparison,
    Normalization,
    PeerGroupEvidence,
    TimeStats,
)
from controller.logic.detection.c4d.job_evidence import (
    NonfiniteEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.c4d.peers import PeerBasis
from controller.logic.detection.incident_evidence import IncidentEvidence
from controller.services.incidents import IncidentSpec
from controller.state import IncidentState
from tests import http_calls
from tests.remediation.recording import RecordingActuator
from tests.waiting import wait_for

#: A test that runs a live controller: SQLite, the engine ticking every 0.2 s.
LIVE = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]
pytestmark = LIVE


def live_test(test: Any) -> Any:
    """:data:`LIVE`'s marks on one test, for modules whose other tests need no controller."""
    for mark in reversed(LIVE):
        test = mark(test)
    return test


#: The engine's periodic task (``Controller.ticks``): "nothing more happened" is asserted
#: after ticks of it, not after a sleep.
ENGINE = "RemediationEngine"


class Agents:
    def __init__(self, live: Any) -> None:
        self.live = live
        self.seq: dict[str, int] = {}
        self.client = http_calls.client(
            base_url=live.url, headers=live.headers("agent"), timeout=10
        )

    def steps(self, node: str, job: str, steps: list[tuple[int, float]]) -> None:
        """Rank 0 of ``job`` on ``node`` completed each (step, end time), 1 s apiece."""
        records = [
            {
                "job": job,
                "rank": 0,
                "world_size": 4,
                "step": step,
                "step_time_s": 1.0,
                "compute_time_s": 0.9,
                "collective_wait_s": 0.1,
                "end_unix_s": end,
            }
            for step, end in steps
        ]
        self.report(node, job={"steps": records})

    def report(
        self, node: str, *, xid: int | None = None, job: dict[str, Any] | None = None
    ) -> None:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        now = time.time()
        gpus = [{"index": i, "uuid": f"{node}-g{i}", "power_w": 300.0} for i in range(2)]
        if xid is not None:
            gpus[1]["xid_events"] = [{"code": xid, "time_unix_s": now, "gpu_index": 1}]
        body = {
            "node": {
                "name": node,
                "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in range(2)],
            },
            "agent_instance": "i1",
            "seq": seq,
            "sent_unix_s": now,
            "samples": [{"time_unix_s": now, "gpus": gpus}],
        }
        if job is not None:
            body["job"] = job
        resp = self.client.post("/api/v1/reports", json=body)
        assert resp.status_code == 200, resp.text


def actions(live: Any) -> list[dict[str, Any]]:
    resp = http_calls.get(f"{live.url}/api/v1/actions", headers=live.headers("viewer"), timeout=10)
    return list(reversed(resp.json()["data"]))  # oldest first


def nodes(live: Any) -> dict[str, dict[str, Any]]:
    resp = http_calls.get(f"{live.url}/api/v1/nodes", headers=live.headers("viewer"), timeout=10)
    return {n["name"]: n for n in resp.json()["data"]}


def test_fatal_xid_isolates_the_node_and_the_circuit_breaker_holds(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory()
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    agents.report("n1", xid=79)
    wait_for(lambda: nodes(live)["n1"]["isolated_reason"])
    isolated = nodes(live)["n1"]
    assert "gpu_fault" in isolated["isolated_reason"] and isolated["isolated_unix_s"]
    kinds = [(a["kind"], a["status"]) for a in actions(live)]
    # No job runs on n1: nothing to checkpoint or restart; the isolation is real.
    assert kinds == [("checkpoint", "skipped"), ("isolate_node", "succeeded")], kinds
    assert all(a["trigger"].startswith("incident:") for a in actions(live))
    # A second fatal fault: 2 of 4 nodes would exceed the default 25 % within the hour.
    agents.report("n2", xid=79)
    skipped = wait_for(
        lambda: [a for a in actions(live) if a["kind"] == "isolate_node" and a["target"] == "n2"]
    )
    assert skipped[0]["status"] == "skipped"
    assert "circuit breaker open" in skipped[0]["outcome"]
    assert nodes(live)["n2"]["isolated_reason"] is None
    # The refusal leaves a faulty node in service: a human hears of it (the default '*'
    # rule alerts the quarantine_budget incident), before the restart below.
    (budget,) = wait_for(
        lambda: [
            i for i in live.controller.state.incidents.values() if i.kind == "quarantine_budget"
        ]
    )
    wait_for(lambda: [a for a in of(live, budget.id) if a["kind"] == "alert"])
    # Decisions survive a restart of the controller: nothing is acted on twice.
    before = len(actions(live))
    live.restart()
    live.wait_ticks(ENGINE, 2)  # the new engine loaded what was decided and looked again
    assert len(actions(live)) == before
    assert nodes(live)["n1"]["isolated_reason"]


def test_dry_run_records_what_it_would_do_and_changes_nothing(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(policy_dry_run=True)
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    agents.report("n3", xid=79)
    rows = wait_for(
        lambda: [a for a in actions(live) if a["kind"] == "isolate_node" and a["target"] == "n3"]
    )
    assert rows[0]["status"] == "dry_run" and rows[0]["outcome"] == "would isolate n3"
    # Every step of the remediation has run (in a dry run), and the engine ticked since.
    remediation_over(live, int(rows[0]["trigger"].removeprefix("incident:")))
    live.wait_ticks(ENGINE)
    assert nodes(live)["n3"]["isolated_reason"] is None


def test_policy_and_isolation_api(controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "dry_run: false\n"
        "rules:\n"
        "  - {kind: gpu_fault, severity: critical, steps: [isolate]}\n"
        "  - {kind: '*', steps: [alert]}\n"
        "guards: {max_isolated_fraction: 0.5}\n"
    )
    live = controller_factory(policy_file=policy_file)
    agents = Agents(live)
    agents.report("a")
    agents.report("b")
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)
    state = viewer.get("/api/v1/remediation").json()
    assert [r["kind"] for r in state["policy"]["rules"]] == ["gpu_fault", "*"]
    assert state["policy"]["guards"]["max_isolated_fraction"] == 0.5
    # Strict validation: the message names the field.
    bad = op.put(
        "/api/v1/remediation/policy", json={"rules": [{"kind": "hang", "steps": ["nuke"]}]}
    )
    assert bad.status_code == 422 and "rules.0.steps.0" in bad.json()["detail"]
    # A rule for a kind nothing opens would never match: refused, naming the likely kind.
    rule = {"kind": "gpu_fualt", "severity": "critical", "steps": ["isolate"]}
    misspelt = op.patch("/api/v1/remediation/policy", json={"rules": [rule]})
    assert misspelt.status_code == 422, misspelt.text
    assert "rules.0.kind" in misspelt.json()["detail"]
    assert "did you mean 'gpu_fault'" in misspelt.json()["detail"]
    typo = op.put("/api/v1/remediation/policy", json={"dry_rn": True})
    assert typo.status_code == 422 and "dry_rn" in typo.json()["detail"]
    assert viewer.put("/api/v1/remediation/policy", json={}).status_code == 403
    # PATCH changes the fields given (PUT would replace the rules and guards as well).
    assert op.patch("/api/v1/remediation/policy", json={"dry_run": True}).status_code == 200
    state = viewer.get("/api/v1/remediation").json()
    assert state["dry_run"] is True
    assert [r["kind"] for r in state["policy"]["rules"]] == ["gpu_fault", "*"]
    assert state["policy"]["guards"]["max_isolated_fraction"] == 0.5
    # Isolation by hand, with the clear errors an operator needs.
    assert op.post("/api/v1/nodes/a/isolate", json={"reason": "bad fan"}).status_code == 200
    again = op.post("/api/v1/nodes/a/isolate", json={"reason": "bad fan"})
    assert again.status_code == 409 and "already isolated" in again.json()["detail"]
    assert nodes(live)["a"]["isolated_reason"] == "bad fan"
    missing = op.post("/api/v1/nodes/zz/release")
    assert missing.status_code == 404 and "not found" in missing.json()["detail"]
    assert op.post("/api/v1/nodes/a/release").status_code == 200
    assert nodes(live)["a"]["isolated_reason"] is None
    assert viewer.post("/api/v1/nodes/a/isolate", json={"reason": "x"}).status_code == 403
    by_hand = [a for a in actions(live) if a["trigger"].startswith("operator:")]
    assert [a["kind"] for a in by_hand] == ["set_policy", "isolate_node", "release_node"]
    assert op.get("/api/v1/jobs/nope/goodput").status_code == 404


# ---------------------------------------------------------------------- helpers for the rest


def on_loop(live: Any, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the live controller's event loop (where its services live)."""
    loop = live._server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)


def ranks_started(agents: Agents, name: str, on: tuple[str, ...]) -> None:
    """Rank ``i`` of job ``name`` started on node ``on[i]`` (its agent says so)."""
    for rank, node in enumerate(on):
        event = {"job": name, "rank": rank, "kind": "started", "time_unix_s": time.time()}
        agents.report(node, job={"rank_events": [event]})


def fleet(
    controller_factory: Any, tmp_path: Path, policy: str, nodes: int, **settings: Any
) -> tuple[Any, Agents]:
    """A live controller under ``policy`` with ``nodes`` nodes n0, n1, ... reporting."""
    live = controller_factory(policy_file=policy_file(tmp_path, policy), **settings)
    agents = Agents(live)
    for i in range(nodes):
        agents.report(f"n{i}")
    return live, agents


def two_jobs_on_n1(
    controller_factory: Any, tmp_path: Path, steps: str, actuator_cls: type[RecordingActuator]
) -> tuple[Any, Agents, RecordingActuator]:
    """Six nodes; job ``ja`` runs on n0 and n1, ``jb`` on n1 and n2 (spares n3, n4), their
    ranks started; a critical ``gpu_fault`` rule runs ``steps`` (``isolate``, ...)."""
    policy = (
        f"rules:\n  - {{kind: gpu_fault, severity: critical, steps: [{steps}]}}\n"
        "  - {kind: '*', steps: [alert]}\nguards: {max_isolated_fraction: 0.5}\n"
    )
    live, agents = fleet(controller_factory, tmp_path, policy, 6, quarantine_budget_share=0.5)
    actuator = actuator_cls(
        placements={
            "ja": Placement(job="ja", nodes=("n0", "n1"), ranks_per_node=1),
            "jb": Placement(job="jb", nodes=("n1", "n2"), ranks_per_node=1),
        },
        pools={"ja": ["n0", "n1", "n3"], "jb": ["n1", "n2", "n4"]},
    )
    live.controller.remediation.actuator = actuator
    ranks_started(agents, "ja", ("n0", "n1"))
    ranks_started(agents, "jb", ("n1", "n2"))
    return live, agents, actuator


def incidents_of(live: Any, kind: str) -> list[IncidentState]:
    """The open incidents of ``kind`` (the controller's memory: ``state.incidents``)."""
    return [i for i in live.controller.state.incidents.values() if i.kind == kind]


def open_incident(
    live: Any,
    kind: str,
    *,
    job: str | None = "gpt",
    node: str | None = None,
    severity: str = "warning",
    evidence: IncidentEvidence | None = None,
) -> int:
    spec = IncidentSpec(
        kind=kind,
        severity=severity,
        summary=f"test {kind}",
        dedupe_key=f"test:{kind}:{secrets.token_hex(4)}",
        node=node,
        job=job,
        evidence=evidence,
    )
    incident, opened = on_loop(live, live.controller.incidents.open_or_bump(spec))
    assert opened
    return int(incident.id)


def recording(live: Any, *, nodes: tuple[str, ...], pool: list[str]) -> RecordingActuator:
    """Give the live engine a recording actuator running job ``gpt`` on ``nodes``."""
    actuator = RecordingActuator(
        placements={"gpt": Placement(job="gpt", nodes=nodes, ranks_per_node=2)},
        pools={"gpt": pool},
    )
    live.controller.remediation.actuator = actuator
    return actuator


def refresh_incident(
    live: Any, incident: int, summary: str, evidence: IncidentEvidence
) -> IncidentSpec:
    """What a detector's refresh does: a newer reading of the open incident, same key."""
    state = live.controller.state.incidents[incident]
    spec = IncidentSpec(
        kind=state.kind,
        severity=state.severity,
        summary=summary,
        dedupe_key=state.dedupe_key,
        node=state.node,
        job=state.job,
        evidence=evidence,
    )
    on_loop(live, live.controller.incidents.open_or_bump(spec, count=0, refresh=True))
    return spec


def straggler_evidence(slowdown_pct: float) -> StragglerIncidentEvidence:
    """A straggler's evidence as the job detection service stores it: rank 1 on n1 computes
    ``slowdown_pct`` longer than its three peers (the number the cost guard reads)."""
    peers = TimeStats(median=0.100, spread=0.002, steps=60)
    slow = TimeStats(median=0.100 * (1 + slowdown_pct / 100), spread=0.002, steps=20)
    wait = TimeStats(median=0.010, spread=0.001, steps=20)
    return StragglerIncidentEvidence(
        rank=1,
        node="n1",
        gpu_index=1,
        slowdown_pct=slowdown_pct,
        step_cost_pct=slowdown_pct * 0.8,
        score=1 + slowdown_pct / 100,
        z=12.0,
        confidence=0.9,
        window_steps=20,
        peer_group=PeerGroupEvidence(
            label="job", basis=PeerBasis.JOB, role=None, ranks=[0, 1, 2, 3], why="no roles"
        ),
        normalization=Normalization.PEER_MEDIAN,
        compute_s=Comparison(culprit=slow, peers=peers),
        collective_wait_s=Comparison(culprit=wait, peers=wait),
        step_time_s=Comparison(culprit=slow, peers=slow),
        bytes_moved=None,
        flagged_steps=20,
        of_steps=20,
        flaps=0,
        verdict=f"rank 1 computes {slowdown_pct:.0f}% longer than its peers",
        nodes=["n1"],
        causes=[],
    )


def remediation_over(
    live: Any, incident: int, *, meanwhile: Callable[[], None] | None = None
) -> None:
    """Wait until the engine acted on ``incident`` and every remediation of it has ended
    (each of its steps has run, or it stopped): nothing more of it can happen.
    ``meanwhile`` runs at every look (the healthy agents' reports, where a test's nodes
    must not fall silent while it waits: silence of many reads as a partition)."""

    def over() -> bool:
        if meanwhile is not None:
            meanwhile()
        engine = live.controller.remediation
        states = [r.state for r in engine.remediations if r.incident_id == incident]
        return bool(states) and "running" not in states

    wait_for(over)


def of(live: Any, incident: int) -> list[dict[str, Any]]:
    return [a for a in actions(live) if a["trigger"] == f"incident:{incident}"]


def policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


STRAGGLER_POLICY = (
    "rules:\n"
    "  - {kind: straggler, steps: [alert, checkpoint, isolate, restart], after_s: 3,\n"
    "     min_cost_pct: 10}\n"
    "  - {kind: '*', steps: [alert]}\n"
)


def test_a_straggler_is_alerted_at_once_and_escalated_after_its_window(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(policy_file=policy_file(tmp_path, STRAGGLER_POLICY))
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    incident = open_incident(live, "straggler", node="n1", evidence=straggler_evidence(25.0))
    alert = wait_for(lambda: of(live, incident))
    assert [(a["kind"], a["status"]) for a in alert] == [("alert", "succeeded")]
    assert "then checkpoint, isolate, restart if it persists 3 s" in alert[0]["outcome"]
    # Inside the persistence window: alerted, nothing else (the engine looked again).
    live.wait_ticks(ENGINE)
    assert [a["kind"] for a in of(live, incident)] == ["alert"]
    assert live.controller.remediation.decided.get(incident) is None
    assert actuator.restarts() == []
    # Past the window, and it costs more than the threshold: checkpoint, isolate, restart.
    wait_for(lambda: any(a["kind"] == "restart_job" for a in of(live, incident)))
    rows = of(live, incident)
    assert [a["kind"] for a in rows] == ["alert", "checkpoint", "isolate_node", "restart_job"]
    opened = incident_opened_at(live, incident)
    assert rows[1]["created_unix_s"] >= opened + 3.0
    assert rows[2]["status"] == "succeeded" and rows[3]["status"] == "succeeded"
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n2")]


def incident_opened_at(live: Any, incident: int) -> float:
    resp = http_calls.get(
        f"{live.url}/api/v1/incidents/{incident}", headers=live.headers("viewer"), timeout=10
    )
    return float(resp.json()["opened_unix_s"])


def test_a_cheap_straggler_is_only_alerted(controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(policy_file=policy_file(tmp_path, STRAGGLER_POLICY))
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    incident = open_incident(live, "straggler", node="n1", evidence=straggler_evidence(4.0))
    wait_for(lambda: of(live, incident))
    # Past after_s, and the engine looked again: it persists, but costs less than min_cost_pct.
    time.sleep(max(0.0, incident_opened_at(live, incident) + 3.0 - time.time()))
    live.wait_ticks(ENGINE)
    assert [(a["kind"], a["status"]) for a in of(live, incident)] == [("alert", "succeeded")]
    assert actuator.acts() == []
    assert live.controller.remediation.decided.get(incident) is None  # still watched
    # The detector's refresh says it grew past the threshold: now it escalates.
    spec = refresh_incident(
        live, incident, "rank 1 computes 30% longer than its peers", straggler_evidence(30.0)
    )
    wait_for(lambda: any(a["kind"] == "restart_job" for a in of(live, incident)))
    assert [a["kind"] for a in of(live, incident)] == [
        "alert",
        "checkpoint",
        "isolate_node",
        "restart_job",
    ]
    shown = http_calls.get(
        f"{live.url}/api/v1/incidents/{incident}", headers=live.headers("viewer"), timeout=10
    ).json()
    assert shown["evidence"]["slowdown_pct"] == 30.0 and shown["count"] == 1
    assert shown["summary"] == "rank 1 computes 30% longer than its peers"
    # A refresh of a condition no longer open (an operator resolved it) opens it again.
    gone = dataclasses.replace(spec, dedupe_key="test:straggler:resolved-by-hand")
    reopened, opened = on_loop(
        live, live.controller.incidents.open_or_bump(gone, count=0, refresh=True)
    )
    assert opened and reopened.count == 1


def test_restart_rate_limit_holds_and_survives_a_controller_restart(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    path = policy_file(
        tmp_path,
        "rules: [{kind: comm_failure, steps: [restart]}]\n"
        "guards: {max_restarts_per_job: 1, settle_s: 0, resume_timeout_s: 1}\n",
    )
    live = controller_factory(policy_file=path)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    first = open_incident(live, "comm_failure")
    done = wait_for(lambda: [a for a in of(live, first) if a["status"] != "pending"])
    assert [(a["kind"], a["status"]) for a in done] == [("restart_job", "succeeded")]
    # No rank steps here: the restart is reported as failed to resume, and the job is free.
    wait_for(lambda: live.controller.remediation.jobs["gpt"].awaiting_resume is None)
    second = open_incident(live, "comm_failure")
    skipped = wait_for(lambda: of(live, second))
    assert skipped[0]["kind"] == "restart_job" and skipped[0]["status"] == "skipped"
    assert skipped[0]["outcome"].startswith("rate limit: job gpt was restarted 1 times")
    assert len(actuator.restarts()) == 1
    # A new leader (here: the controller restarted) counts the restart its predecessor made.
    live.restart()
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    third = open_incident(live, "comm_failure")
    skipped = wait_for(lambda: of(live, third))
    assert skipped[0]["status"] == "skipped" and "rate limit" in skipped[0]["outcome"]
    assert actuator.restarts() == []


def test_no_action_on_stale_evidence(controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rules = "rules: [{kind: comm_failure, steps: [restart]}]\nguards: {stale_after_s: 1}\n"
    live = controller_factory(policy_file=policy_file(tmp_path, "enabled: false\n" + rules))
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    incident = open_incident(live, "comm_failure")
    # The engine is off while the incident's evidence ages past stale_after_s.
    updated = live.controller.state.incidents[incident].updated_unix_s
    time.sleep(max(0.0, updated + 1.0 - time.time()) + 0.1)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    body = {
        "rules": [{"kind": "comm_failure", "steps": ["restart"]}],
        "guards": {"stale_after_s": 1},
    }
    assert op.put("/api/v1/remediation/policy", json=body).status_code == 200
    rows = wait_for(lambda: of(live, incident))
    assert [(a["kind"], a["status"]) for a in rows] == [("skip", "skipped")]
    assert rows[0]["outcome"].startswith("stale evidence: the incident was last updated")
    live.wait_ticks(ENGINE)
    assert len(of(live, incident)) == 1 and actuator.acts() == []


class PlacementReads(RecordingActuator):
    """Counts the reads of where a job runs: while none of its remediations is under way,
    only the engine's grow-back check asks (every ``remediation_grow_check_interval_s``)."""

    reads = 0

    async def current_placement(self, job: str) -> Placement | None:
        self.reads += 1
        return await super().current_placement(job)


def grow_check_passed(live: Any, actuator: PlacementReads) -> None:
    """Wait for a grow-back check that found nothing in its way (the job's remediation and
    its resume wait over) and read where job ``gpt`` runs, and for its tick to end."""
    book = live.controller.remediation.jobs["gpt"]
    wait_for(lambda: book.running is None and book.awaiting_resume is None)
    seen = actuator.reads
    wait_for(lambda: actuator.reads > seen)
    live.wait_ticks(ENGINE)


def grow_backs(live: Any) -> list[Any]:
    return [r for r in live.controller.remediation.remediations if r.grow]


def test_a_shrunk_job_grows_back_when_its_node_is_released(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, fast_remediation_engine
) -> None:
    # The grow-back check every engine tick instead of every 5 s: the test waits for three
    # of them (no capacity, capacity back, full size), and what each finds is the point.
    grow_every = {"remediation_grow_check_interval_s": fast_remediation_engine}
    path = policy_file(
        tmp_path,
        "rules: [{kind: gpu_fault, severity: critical, steps: [isolate, restart]}]\n"
        "guards: {settle_s: 0, resume_timeout_s: 1}\n"
        "restarts: {grow: true}\n",
    )
    live = controller_factory(policy_file=path, **grow_every)
    engine = live.controller.remediation
    assert engine.tick_interval_s == engine._grow.check_interval_s == fast_remediation_engine
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = PlacementReads(
        placements={"gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=2)},
        pools={"gpt": ["n0", "n1"]},
    )
    live.controller.remediation.actuator = actuator
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    wait_for(lambda: actuator.restarts())
    shrunk = actuator.restarts()[0]
    assert shrunk.nodes == ("n0",) and shrunk.generation == 1
    rows = wait_for(lambda: [a for a in of(live, incident) if a["kind"] == "restart_job"])
    assert rows[0]["params"]["plan"] == "shrink" and rows[0]["params"]["original_nodes"] == 2
    # n1 is isolated: no capacity to grow into, whatever the grow-back check finds.
    grow_check_passed(live, actuator)
    assert len(actuator.restarts()) == 1 and grow_backs(live) == []
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.post("/api/v1/nodes/n1/release").status_code == 200
    wait_for(lambda: len(actuator.restarts()) == 2, timeout_s=20)
    grown = actuator.restarts()[1]
    assert grown.nodes == ("n0", "n1") and grown.generation == 2
    grow_rows = wait_for(
        lambda: [
            a
            for a in actions(live)
            if a["trigger"] == "grow:gpt"
            and a["kind"] == "restart_job"
            and a["status"] != "pending"
        ]
    )
    assert grow_rows[0]["status"] == "succeeded" and grow_rows[0]["params"]["plan"] == "grow"
    kinds = [a["kind"] for a in actions(live) if a["trigger"] == "grow:gpt"]
    assert kinds == ["checkpoint", "restart_job"]  # a protective checkpoint first
    remediation = http_calls.get(
        f"{live.url}/api/v1/remediation", headers=live.headers("viewer"), timeout=10
    ).json()
    grow = [r for r in remediation["remediations"] if r["trigger"] == "grow:gpt"]
    assert grow and grow[0]["incident"] is None and grow[0]["generation"] == 2
    grow_check_passed(live, actuator)  # back at full size: nothing more to do
    assert len(actuator.restarts()) == 2 and len(grow_backs(live)) == 1


def test_goodput_is_rebuilt_from_the_restart_rows_by_a_new_leader(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    path = policy_file(tmp_path, "rules: [{kind: comm_failure, steps: [restart]}]\n")
    live = controller_factory(policy_file=path)
    agents = Agents(live)
    recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    now = time.time()
    agents.steps("n0", "gpt", [(s, now - 6 + s) for s in range(1, 6)])
    incident = open_incident(live, "comm_failure")
    wait_for(lambda: [a for a in of(live, incident) if a["status"] == "succeeded"])
    agents.steps("n0", "gpt", [(1, time.time())])  # the restarted job steps again
    row = wait_for(
        lambda: [a for a in of(live, incident) if "resumed_unix_s" in a["params"]["goodput"]]
    )[0]
    assert row["params"]["resumed_step"] == 1 and row["params"]["goodput"]["last_step"] == 5
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)
    before = viewer.get("/api/v1/jobs/gpt/goodput").json()["incidents"]
    assert [(i["incident_id"], i["state"], i["recomputed_steps"]) for i in before] == [
        (str(incident), "resumed", 5)
    ]
    live.restart()
    after = wait_for(lambda: viewer.get("/api/v1/jobs/gpt/goodput").json().get("incidents"))
    keys = ("incident_id", "kind", "state", "recomputed_steps", "restart_s", "recomputed_s")
    assert [{k: i[k] for k in keys} for i in after] == [{k: i[k] for k in keys} for i in before]
    assert after[0]["lost_s"] == pytest.approx(before[0]["lost_s"], abs=0.5)


def committed(
    agents: Agents, node: str, job: str, steps: list[int], *, kind: str = "committed"
) -> None:
    """Rank 0 of ``job`` reports checkpoint events of ``kind`` for ``steps``."""
    now = time.time()
    events = [{"job": job, "rank": 0, "step": s, "kind": kind, "time_unix_s": now} for s in steps]
    agents.report(node, job={"checkpoints": events})


#: What the NaN/Inf detector stores: rank 2's all_reduce input first held NaN at step 30,
#: seen in 3 steps so far.
NAN_EVIDENCE = NonfiniteEvidence(
    step=30,
    op="all_reduce",
    group="0",
    seq=41,
    origin_ranks=[2],
    nonfinite_ranks=[0, 1, 2, 3],
    first_seq_by_rank={"0": 41, "1": 41, "2": 41, "3": 41},
    nonfinite_calls_by_rank={"0": 1, "1": 1, "2": 1, "3": 1},
    clean_ranks=0,
    gpu_index=2,
    confidence=1.0,
    bad_steps=3,
)


def test_nonfinite_rolls_back_to_the_newest_checkpoint_before_the_bad_step(  # type: ignore[no-untyped-def]
    controller_factory,
) -> None:
    """The default policy: NaN first seen at step 30 with checkpoints committed at 10, 20
    and 30 (the last one may hold the damage) restarts the job from step 20. A checkpoint
    that only got as far as ``durable`` never counts."""
    live = controller_factory()
    agents = Agents(live)
    for i in range(3):
        agents.report(f"n{i}")
    agents.steps("n0", "gpt", [(s, time.time() - 40 + s) for s in range(28, 32)])
    committed(agents, "n0", "gpt", [10, 20, 30])
    committed(agents, "n0", "gpt", [25], kind="durable")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    # One bad step may be an fp16 overflow that the loss scaler skips: alerted only.
    incident = open_incident(
        live,
        "nonfinite",
        node="n1",
        severity="critical",
        evidence=NAN_EVIDENCE.model_copy(update={"bad_steps": 1}),
    )
    alert = wait_for(lambda: of(live, incident))
    assert [a["kind"] for a in alert] == ["alert"]
    assert "rollback if it lasts 3 steps" in alert[0]["outcome"]
    live.wait_ticks(ENGINE)  # the engine looked at it again
    assert [a["kind"] for a in of(live, incident)] == ["alert"] and actuator.acts() == []
    assert live.controller.remediation.decided.get(incident) is None
    # The detector's refresh: the NaN is still there two steps later (a diverged model).
    refresh_incident(
        live, incident, "job gpt step 30: NaN; NaN/Inf in 3 steps so far", NAN_EVIDENCE
    )
    rows = wait_for(
        lambda: (
            [
                a
                for a in of(live, incident)
                if a["kind"] == "restart_job" and a["status"] != "pending"
            ]
            and of(live, incident)
        )
    )
    kinds = [a["kind"] for a in rows]
    assert kinds[:2] == ["alert", "capture_evidence"] and kinds[-1] == "restart_job", kinds
    isolate = [a for a in rows if a["kind"] == "isolate_node"]
    assert isolate and isolate[0]["status"] == "skipped"  # a first offence: no hardware evidence
    restart = rows[-1]
    assert restart["status"] == "succeeded", restart["outcome"]
    assert restart["params"]["resume_step"] == 20
    assert restart["params"]["rollback"] == {"bad_step": 30}
    assert "from step 20" in restart["outcome"]
    assert [p.resume_step for p in actuator.restarts()] == [20]


def test_a_restart_is_not_pinned_and_its_protective_checkpoint_is_one_request(  # type: ignore[no-untyped-def]
    controller_factory,
) -> None:
    """A fatal XID on n1 under job gpt (ranks on n0 and n1). Every node is asked for the
    protective checkpoint with the same request number (its action id), so the ranks take
    one checkpoint, not one per node. The restart records the newest checkpoint at its
    decision but does not bound the job to it: the job checkpoints on until its ranks are
    stopped, and retention could delete that one by then (a pinned restart then had
    nothing to resume from)."""
    live = controller_factory()
    agents = Agents(live)
    for i in range(3):
        agents.report(f"n{i}")
    now = time.time()
    for node, rank in (("n0", 0), ("n1", 2)):
        step = {"job": "gpt", "rank": rank, "world_size": 4, "step": 20, "step_time_s": 1.0,
                "compute_time_s": 0.9, "collective_wait_s": 0.1, "end_unix_s": now}  # fmt: skip
        agents.report(node, job={"steps": [step]})
    committed(agents, "n0", "gpt", [10, 20])
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    agents.report("n1", xid=79)
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)

    def asked() -> list[dict[str, Any]]:
        found = viewer.get("/api/v1/commands").json()["data"]
        return [c for c in found if c["kind"] == "job_checkpoint"]

    commands = wait_for(lambda: len(asked()) == 2 and asked())
    checkpoint = wait_for(lambda: [a for a in actions(live) if a["kind"] == "checkpoint"])[0]
    assert sorted(c["node"] for c in commands) == ["n0", "n1"]
    assert {c["params"]["request"] for c in commands} == {checkpoint["id"]}
    committed(agents, "n0", "gpt", [25])  # the protective checkpoint
    restart = wait_for(
        lambda: [
            a for a in actions(live) if a["kind"] == "restart_job" and a["status"] != "pending"
        ]
    )[0]
    assert restart["status"] == "succeeded", restart["outcome"]
    assert restart["params"]["resume_step"] == 25 and "rollback" not in restart["params"]
    assert "from the newest checkpoint (step 25 now)" in restart["outcome"], restart["outcome"]
    assert [p.resume_step for p in actuator.restarts()] == [None]


def test_nonfinite_without_a_clean_checkpoint_is_left_to_a_human(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory()
    agents = Agents(live)
    agents.report("n0")
    agents.steps("n0", "gpt", [(5, time.time())])
    committed(agents, "n0", "gpt", [5])
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    evidence = NAN_EVIDENCE.model_copy(update={"step": 5})
    incident = open_incident(live, "nonfinite", severity="critical", evidence=evidence)
    rows = wait_for(lambda: [a for a in of(live, incident) if a["kind"] == "restart_job"])
    assert rows[0]["status"] == "skipped"
    assert rows[0]["outcome"].startswith(
        "no checkpoint of job gpt was committed before step 5: nothing clean to roll back to"
    )
    assert actuator.restarts() == []
    remediation = next(r for r in live.controller.remediation.remediations if r.job == "gpt")
    wait_for(lambda: remediation.state == "failed")


def test_checkpoint_freshness_is_exported_for_the_not_durable_alert(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 22: TrainguardCheckpointsNotDurable reads when each job last committed, its
    interval as observed between two commits, and its newest step. Only ``committed`` counts
    (a ``durable`` of one rank is not a checkpoint yet); a later commit at a lower step
    (after a rollback) still moves the time on."""
    live = controller_factory()
    agents = Agents(live)
    t0 = time.time() - 600.0

    def checkpoint(step: int, t: float, kind: str = "committed") -> None:
        event = {"job": "gpt", "rank": 0, "step": step, "kind": kind, "time_unix_s": t}
        agents.report("n0", job={"checkpoints": [event]})

    def gauges() -> dict[str, float]:
        text = http_calls.get(f"{live.url}/metrics").text
        found = re.findall(
            r'^(trainguard_job_(?:checkpoint|last_step)\w*)\{job_name="gpt"\} (\S+)$', text, re.M
        )
        return {name: float(value) for name, value in found}

    checkpoint(10, t0)
    first = wait_for(gauges)
    assert first == {"trainguard_job_checkpoint_committed_timestamp_seconds": t0}
    checkpoint(20, t0 + 300.0, kind="durable")
    checkpoint(5, t0 + 240.0)  # rolled back, committed again at a lower step
    agents.steps("n0", "gpt", [(6, t0 + 250.0)])
    after = wait_for(lambda: len(gauges()) == 3 and gauges())
    assert after == {
        "trainguard_job_checkpoint_committed_timestamp_seconds": t0 + 240.0,
        "trainguard_job_checkpoint_interval_seconds": 240.0,
        "trainguard_job_last_step_timestamp_seconds": t0 + 250.0,
    }


def absorbed(live: Any, incident: int) -> bool:
    """Whether ``incident`` was resolved as part of a remediation it did not start (the
    engine's own ``decided`` forgets a closed incident at its next tick)."""
    shown = live.read(f"/api/v1/incidents/{incident}")
    note = str(shown["evidence"].get("resolution", ""))
    return shown["state"] == "resolved" and note.startswith("absorbed: ")


def shown_state(live: Any, incident: int) -> str:
    resp = http_calls.get(
        f"{live.url}/api/v1/incidents/{incident}", headers=live.headers("viewer"), timeout=10
    )
    return str(resp.json()["state"])


class GatedActuator(RecordingActuator):
    """A restart that waits for the test (the remediation stays busy) and then succeeds or
    fails (an API server refusing it)."""

    def __init__(self, *args: Any, succeed: bool, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.succeed = succeed

    async def restart_job(self, placement: Placement, *, reason: str) -> Any:
        await asyncio.to_thread(self.gate.wait, 30)
        if not self.succeed:
            raise ActuatorError("the API server refused the restart")
        return await super().restart_job(placement, reason=reason)


@pytest.mark.parametrize("restarted", [True, False], ids=["restarted", "restart-failed"])
def test_an_incident_raised_during_a_remediation_is_absorbed_only_by_a_real_restart(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, restarted
) -> None:
    """A straggler that opens while another remediation of its job runs is that remediation's
    consequence only if the job was restarted; after a restart that failed, the job runs on
    as it was and the straggler (which its detector will not raise twice) is acted on."""
    policy = "rules:\n  - {kind: hang, steps: [restart]}\n  - {kind: '*', steps: [alert]}\n"
    live = controller_factory(policy_file=policy_file(tmp_path, policy))
    agents = Agents(live)
    for i in range(3):
        agents.report(f"n{i}")
    actuator = GatedActuator(
        placements={"gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=2)},
        pools={"gpt": ["n0", "n1", "n2"]},
        succeed=restarted,
    )
    live.controller.remediation.actuator = actuator
    hang = open_incident(live, "hang", severity="critical")
    wait_for(lambda: any(a["kind"] == "restart_job" for a in of(live, hang)))
    straggler = open_incident(live, "straggler", node="n1", evidence=straggler_evidence(25.0))
    live.wait_ticks(ENGINE)  # the engine ticks while the restart is held: nothing decided yet
    assert of(live, straggler) == [] and straggler not in live.controller.remediation.decided
    assert shown_state(live, straggler) == "open"
    actuator.gate.set()
    if restarted:
        wait_for(lambda: shown_state(live, straggler) == "resolved")
        assert absorbed(live, straggler)
        assert of(live, straggler) == []
    else:
        alert = wait_for(lambda: of(live, straggler))
        assert [(a["kind"], a["status"]) for a in alert] == [("alert", "succeeded")]
        assert shown_state(live, straggler) == "open"
        restart = [a for a in of(live, hang) if a["kind"] == "restart_job"]
        assert restart[0]["status"] == "failed"
