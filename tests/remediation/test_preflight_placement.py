"""A node whose last preflight failed is not given to a job (issue 17).

Pure verdict logic on plain data, then a live controller: an agent acks a failed preflight
for a spare, a GPU fault forces a restart, and the restart takes the other spare and says
why in its action's reason.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from controller.logic.remediation.preflight import (
    FinishedCommand,
    PreflightVerdict,
    describe_exclusions,
    failed_nodes,
    latest_verdicts,
)
from tests import http_calls
from tests.remediation.test_engine import (
    Agents,
    actions,
    of,
    open_incident,
    policy_file,
    recording,
)
from tests.waiting import wait_for


def _cmd(node: str, status: str, at: float | None, reason: str = "") -> FinishedCommand:
    return FinishedCommand(
        node=node, kind="run_preflight", status=status, reason=reason, finished_unix_s=at
    )


def test_the_newest_finished_verdict_wins_and_expired_ones_do_not_count() -> None:
    verdicts = latest_verdicts(
        {},
        [
            _cmd("a", "failed", 10.0, "gpu0 ecc: 3 uncorrectable"),
            _cmd("b", "failed", 10.0, "nic mlx5_0 port 1 down"),
            _cmd("b", "succeeded", 20.0),  # a newer pass clears b
            _cmd("c", "expired", 30.0),  # no answer: no verdict
            _cmd("d", "pending", None),
            FinishedCommand(
                node="e", kind="set_power_limit", status="failed", reason="x", finished_unix_s=5.0
            ),
        ],
    )
    assert sorted(verdicts) == ["a", "b"]
    assert failed_nodes(verdicts) == {"a": "gpu0 ecc: 3 uncorrectable"}
    # Kept verdicts survive their commands leaving memory; an older one does not override.
    kept = latest_verdicts(verdicts, [_cmd("a", "succeeded", 5.0)])
    assert failed_nodes(kept) == {"a": "gpu0 ecc: 3 uncorrectable"}
    assert failed_nodes(latest_verdicts(kept, [_cmd("a", "succeeded", 11.0)])) == {}


def test_the_reason_names_only_failed_nodes_the_job_could_have_used() -> None:
    failed = failed_nodes(
        {
            "n2": PreflightVerdict(
                node="n2", passed=False, reason="row remap pending", finished_unix_s=1.0
            )
        }
    )
    assert describe_exclusions(failed, ["n0", "n1"]) == ""
    assert describe_exclusions(failed, ["n0", "n2", "n2"]) == (
        "not placed on n2 (last preflight failed: row remap pending)"
    )


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_restart_skips_the_spare_whose_last_preflight_failed(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    path = policy_file(
        tmp_path,
        "rules: [{kind: gpu_fault, severity: critical, steps: [isolate, restart]}]\n"
        "guards: {settle_s: 0, resume_timeout_s: 1}\n",
    )
    live = controller_factory(policy_file=path)
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    created = op.post("/api/v1/nodes/n2/preflight", json={})
    assert created.status_code == 201, created.text
    command_id = created.json()["id"]
    reason = "preflight failed 1/13 checks: gpu1 memory_repair: row remap pending"
    _ack(live, agents, "n2", command_id, "failed", reason)
    got = op.get(f"/api/v1/nodes/n2/preflight/{command_id}").json()
    assert got["status"] == "failed"

    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    wait_for(lambda: actuator.restarts())
    # n2 comes first in the pool, but its last preflight failed: n3 replaces n1.
    assert actuator.restarts()[0].nodes == ("n0", "n3")
    rows = wait_for(lambda: [a for a in of(live, incident) if a["kind"] == "restart_job"])
    said = rows[0]["params"]["reason"]
    assert "replace n1 by n3" in said
    assert f"not placed on n2 (last preflight failed: {reason})" in said
    assert all("n2" not in a["params"].get("nodes", []) for a in actions(live))


def _ack(live: Any, agents: Agents, node: str, command_id: str, status: str, why: str) -> None:
    """A report from ``node`` carrying the agent's ack of ``command_id``."""
    seq = agents.seq.get(node, 0)
    agents.seq[node] = seq + 1
    now = time.time()
    body = {
        "node": {"name": node, "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in range(2)]},
        "agent_instance": "i1",
        "seq": seq,
        "sent_unix_s": now,
        "samples": [{"time_unix_s": now, "gpus": []}],
        "command_acks": [
            {"command_id": command_id, "status": status, "reason": why, "finished_unix_s": now}
        ],
    }
    resp = agents.client.post("/api/v1/reports", json=body)
    assert resp.status_code == 200, resp.text
