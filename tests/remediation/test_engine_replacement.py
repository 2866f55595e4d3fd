"""A replacement node fails before the restarted job has resumed on it.

Job ``gpt`` runs on n0 and n1; an XID on n1 moves it to n0 and n2 (generation 1). Until
generation 1 reports, the job's ranks still name n0 and n1: n2 belongs to the job only
through the restart in flight. A fatal XID on n2 then must be remediated as a fault of the
job (restarted again, without n1 and n2), not as a fault of a node that runs nothing.
"""

from __future__ import annotations

import time
from typing import Any

from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.params import RestartParams
from controller.services.remediation.records import JobBook, Remediation, jobs_of
from controller.state import ClusterState, IncidentState, JobState, RankState
from tests import http_calls
from tests.remediation.test_engine import Agents, actions, live_test, of, policy_file, recording
from tests.waiting import wait_for

POLICY = (
    "rules:\n"
    "  - {kind: gpu_fault, severity: critical, steps: [checkpoint, isolate, restart]}\n"
    "guards: {max_isolated_fraction: 0.5, checkpoint_timeout_s: 1, settle_s: 5,\n"
    "         resume_timeout_s: 60}\n"
)


def started(agents: Agents, on: tuple[str, ...]) -> None:
    """Ranks 0.. of ``gpt`` started on ``on``, one per node."""
    for rank, node in enumerate(on):
        event = {"job": "gpt", "rank": rank, "kind": "started", "time_unix_s": time.time()}
        agents.report(node, job={"rank_events": [event]})


def live_commands(live: Any) -> list[dict[str, Any]]:
    viewer = http_calls.get(
        f"{live.url}/api/v1/commands", headers=live.headers("viewer"), timeout=10
    )
    return list(viewer.json()["data"])


def incident_on(live: Any, node: str) -> int:
    return wait_for(
        lambda: next(
            (i.id for i in live.controller.state.incidents.values() if i.node == node), None
        )
    )


@live_test
def test_a_fault_on_the_replacement_node_before_the_job_resumed_restarts_it_again(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(
        policy_file=policy_file(tmp_path, POLICY), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    started(agents, ("n0", "n1"))
    agents.report("n1", xid=79)
    first = incident_on(live, "n1")
    restart = wait_for(
        lambda: [
            a for a in of(live, first) if a["kind"] == "restart_job" and a["status"] != "pending"
        ]
    )
    assert restart[0]["status"] == "succeeded", restart
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n2")]
    assert live.controller.remediation.jobs["gpt"].awaiting_resume is not None

    agents.report("n2", xid=79)  # generation 1 has not stepped yet
    second = incident_on(live, "n2")
    rows = wait_for(
        lambda: [
            a for a in of(live, second) if a["kind"] == "restart_job" and a["status"] != "pending"
        ],
        timeout_s=20,
    )
    assert [(a["target"], a["status"]) for a in rows] == [("gpt", "succeeded")], rows
    params = rows[0]["params"]
    assert params["generation"] == 2
    assert not {"n1", "n2"} & set(params["nodes"]), params
    assert params["from_nodes"] == ["n0", "n2"]
    isolated = [a["target"] for a in of(live, second) if a["kind"] == "isolate_node"]
    assert isolated == ["n2"]
    # No rank can checkpoint (generation 0 stopped, 1 never stepped): skipped, not asked of
    # generation 0's nodes and waited out.
    (protective,) = [a for a in of(live, second) if a["kind"] == "checkpoint"]
    assert protective["status"] == "skipped", protective
    assert "is restarting (generation 1 has not stepped yet)" in protective["outcome"]
    asked = sorted(c["node"] for c in live_commands(live) if c["kind"] == "job_checkpoint")
    assert asked == ["n0", "n1"], asked  # the first incident's request only
    placements = actuator.restarts()
    assert len(placements) == 2
    assert placements[1].generation == 2
    assert placements[1].nodes == ("n0", "n3")
    engine = live.controller.remediation
    (rem,) = [r for r in engine.remediations if r.incident_id == second]
    assert rem.job == "gpt" and rem.generation == 2
    assert engine.jobs["gpt"].awaiting_resume is rem
    # Nothing else restarted or failed meanwhile (no resume timeout was waited out).
    assert sum(a["kind"] == "restart_job" for a in actions(live)) == 2


def _book(nodes: list[str] | None) -> JobBook:
    book = JobBook(ledger=GoodputLedger("gpt"))
    if nodes is not None:
        rem = Remediation(
            id="r1",
            incident_id=1,
            incident_kind="gpu_fault",
            job="gpt",
            node="n1",
            steps=["restart"],
            started_unix_s=1.0,
            dry_run=False,
            restarted_unix_s=2.0,
            restart_params=RestartParams(job="gpt", nodes=nodes, generation=1),
        )
        book.awaiting_resume = rem
        book.last_restart_unix_s = 2.0
    return book


def test_jobs_of_reads_the_placement_of_a_restart_in_flight() -> None:
    state = ClusterState()
    job = JobState(name="gpt", first_seen_unix_s=1.0, last_seen_unix_s=1.0)
    for rank, node in enumerate(("n0", "n1")):
        job.ranks[rank] = RankState(rank=rank, node=node, last_seen_unix_s=1.0)
    state.jobs["gpt"] = job

    def on(node: str) -> IncidentState:
        return IncidentState(
            id=9,
            kind="gpu_fault",
            severity="critical",
            state="open",
            summary="",
            dedupe_key="k",
            opened_unix_s=3.0,
            updated_unix_s=3.0,
            node=node,
        )

    # No restart in flight: the ranks tell.
    assert [jobs_of(state, on(n), {"gpt": _book(None)}) for n in ("n0", "n1", "n2")] == [
        ["gpt"],
        ["gpt"],
        [],
    ]
    # Restarted onto n0, n2: n2 is the job's, n1 (left behind, stale ranks) is not.
    books = {"gpt": _book(["n0", "n2"])}
    assert [jobs_of(state, on(n), books) for n in ("n0", "n1", "n2", "n3")] == [
        ["gpt"],
        [],
        ["gpt"],
        [],
    ]
    assert jobs_of(state, on("n1")) == ["gpt"]  # without the books: the ranks alone
    # An incident opened before that restart (at 2.0) still concerns the job on its node.
    early = on("n1")
    early.opened_unix_s = 1.5
    assert jobs_of(state, early, books) == ["gpt"]
