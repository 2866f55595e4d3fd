"""An isolation and its audit row are one transaction (issue 14), on SQLite and PostgreSQL.

Each path that isolates a node (an operator's isolate / release, the approval of a dry
run, the policy's ``isolate`` step) is run with the database failing either the node row's
write or the action row's (``ctl_db_outage``: a real SQLAlchemy hook raising the driver's
``OperationalError`` inside the real transaction). Each time nothing of the two is stored,
the API shows what the database holds, the actuator's change is undone (the
:class:`RecordingActuator` is stateful and records every call), and the next request
works and is recorded once.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from controller.actuators.base import Placement
from tests import http_calls
from tests.controller.db_reads import stored_rows as _stored
from tests.remediation.recording import RecordingActuator
from tests.waiting import wait_for

NODE_WRITE = r"^\s*UPDATE nodes SET isolated_reason"
ACTION_INSERT = r"^\s*INSERT INTO actions"


def _report(client: httpx.Client, live: Any, node: str, seq: int, xid: int | None = None) -> None:
    now = time.time()
    gpus: list[dict[str, Any]] = [{"index": i, "uuid": f"{node}-g{i}"} for i in range(2)]
    sample = [{"index": i, "uuid": f"{node}-g{i}", "power_w": 300.0} for i in range(2)]
    if xid is not None:
        sample[1]["xid_events"] = [{"code": xid, "time_unix_s": now, "gpu_index": 1}]
    body = {
        "node": {"name": node, "gpus": gpus},
        "agent_instance": "i1",
        "seq": seq,
        "sent_unix_s": now,
        "samples": [{"time_unix_s": now, "gpus": sample}],
    }
    r = client.post("/api/v1/reports", json=body, headers=live.headers("agent"))
    assert r.status_code == 200, r.text


def _start(controller_factory: Any, **settings: Any) -> tuple[Any, RecordingActuator]:
    live = controller_factory(**settings)
    actuator = RecordingActuator(
        placements={"gpt": Placement(job="gpt", nodes=("n0",), ranks_per_node=2)},
        pools={"gpt": ["n0"]},
    )
    live.controller.remediation.actuator = actuator
    return live, actuator


def _isolated(client: httpx.Client, live: Any, db_url: str, node: str) -> str | None:
    """The node's isolation as the API shows it, asserted equal to the stored one."""
    r = client.get(f"/api/v1/nodes/{node}", headers=live.headers())
    assert r.status_code == 200, r.text
    shown = r.json()["isolated_reason"]
    ((stored,),) = _stored(db_url, "SELECT isolated_reason FROM nodes WHERE name = :n", n=node)
    assert shown == stored
    return shown  # type: ignore[no-any-return]


def _actions(db_url: str, target: str) -> list[tuple[str, str]]:
    rows = _stored(
        db_url, "SELECT kind, status FROM actions WHERE target = :t ORDER BY id", t=target
    )
    return [(kind, status) for kind, status in rows]


def _node_calls(actuator: RecordingActuator, node: str) -> list[str]:
    return [m for m, arg in actuator.calls if m in ("isolate_node", "release_node") and arg == node]


def test_operator_isolation_and_its_action_row_commit_together(
    controller_factory: Any, db_url: str, ctl_db_outage: Any
) -> None:
    live, actuator = _start(controller_factory)
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as client:
        _report(client, live, "w5", 0)
        for pattern in (ACTION_INSERT, NODE_WRITE):
            ctl_db_outage.arm(pattern)
            r = client.post("/api/v1/nodes/w5/isolate", json={"reason": "suspect"})
            assert r.status_code == 503, r.text
            ctl_db_outage.disarm()
            assert _isolated(client, live, db_url, "w5") is None
            assert _actions(db_url, "w5") == []
        # Each refused isolation was undone at the actuator: the node is not cordoned.
        assert _node_calls(actuator, "w5") == ["isolate_node", "release_node"] * 2

        r = client.post("/api/v1/nodes/w5/isolate", json={"reason": "suspect"})
        assert r.status_code == 200, r.text
        assert _isolated(client, live, db_url, "w5") == "suspect"
        assert _actions(db_url, "w5") == [("isolate_node", "succeeded")]

        # A release the database refuses: still isolated everywhere, the actuator too.
        for pattern in (ACTION_INSERT, NODE_WRITE):
            ctl_db_outage.arm(pattern)
            r = client.post("/api/v1/nodes/w5/release", json={"reason": "repaired"})
            assert r.status_code == 503, r.text
            ctl_db_outage.disarm()
            assert _isolated(client, live, db_url, "w5") == "suspect"
            assert _actions(db_url, "w5") == [("isolate_node", "succeeded")]
        assert _node_calls(actuator, "w5")[-4:] == ["release_node", "isolate_node"] * 2
        r = client.post("/api/v1/nodes/w5/release", json={"reason": "repaired"})
        assert r.status_code == 200, r.text
        assert _isolated(client, live, db_url, "w5") is None
        assert _actions(db_url, "w5") == [
            ("isolate_node", "succeeded"),
            ("release_node", "succeeded"),
        ]

        # A policy change whose audit row is not stored does not take effect either.
        before = client.get("/api/v1/remediation").json()["policy"]["dry_run"]
        ctl_db_outage.arm(ACTION_INSERT)
        r = client.put("/api/v1/remediation/policy", json={"dry_run": not before})
        assert r.status_code == 503, r.text
        ctl_db_outage.disarm()
        assert client.get("/api/v1/remediation").json()["policy"]["dry_run"] is before
        assert _stored(db_url, "SELECT id FROM actions WHERE kind = 'set_policy'") == []
        r = client.put("/api/v1/remediation/policy", json={"dry_run": not before})
        assert r.status_code == 200, r.text
        assert client.get("/api/v1/remediation").json()["policy"]["dry_run"] is (not before)


def test_approved_dry_run_isolation_is_stored_with_its_records_or_not_at_all(
    controller_factory: Any, db_url: str, ctl_db_outage: Any
) -> None:
    live, actuator = _start(controller_factory, policy_dry_run=True)
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as client:
        for i in range(4):
            _report(client, live, f"n{i}", 0)
        _report(client, live, "n3", 1, xid=79)
        dry = wait_for(lambda: _actions(db_url, "n3"))
        assert dry == [("isolate_node", "dry_run")]
        ((dry_id,),) = _stored(db_url, "SELECT id FROM actions WHERE target = 'n3'")

        for pattern in (ACTION_INSERT, NODE_WRITE):
            ctl_db_outage.arm(pattern)
            r = client.post(f"/api/v1/actions/{dry_id}/approve")
            assert r.status_code == 503, r.text
            ctl_db_outage.disarm()
            assert _isolated(client, live, db_url, "n3") is None
            assert _actions(db_url, "n3") == dry
            assert _actions(db_url, f"action:{dry_id}") == []  # still approvable
        assert _node_calls(actuator, "n3") == ["isolate_node", "release_node"] * 2

        r = client.post(f"/api/v1/actions/{dry_id}/approve")
        assert r.status_code == 200, r.text
        assert _isolated(client, live, db_url, "n3") is not None
        assert _actions(db_url, "n3") == [*dry, ("isolate_node", "succeeded")]
        assert _actions(db_url, f"action:{dry_id}") == [("approve_action", "succeeded")]
        again = client.post(f"/api/v1/actions/{dry_id}/approve")
        assert again.status_code == 409 and "approved already" in again.json()["detail"]


def test_approved_dry_run_restart_is_claimed_before_the_job_restarts(
    controller_factory: Any, db_url: str, ctl_db_outage: Any
) -> None:
    """A restart cannot share a transaction with its record (the actuator acts in between):
    its approval row is written first, so a database that refuses it refuses the approval
    before the job is touched, and the dry run stays approvable, once."""
    live, actuator = _start(controller_factory, policy_dry_run=True)
    actuator.placements["gpt"] = Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=1)
    actuator.pools["gpt"] = ["n0", "n1", "n2", "n3"]
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as client:
        for i in range(4):
            _report(client, live, f"n{i}", 0)
        step = {
            "job": "gpt", "rank": 0, "world_size": 2, "step": 1, "step_time_s": 1.0,
            "compute_time_s": 0.9, "collective_wait_s": 0.1, "end_unix_s": time.time(),
        }  # fmt: skip
        body = {
            "node": {"name": "n0", "gpus": [{"index": 0, "uuid": "n0-g0"}]},
            "agent_instance": "i1", "seq": 1, "sent_unix_s": time.time(),
            "samples": [], "job": {"steps": [step]},
        }  # fmt: skip
        assert client.post("/api/v1/reports", json=body, headers=live.headers("agent")).is_success
        wait_for(lambda: "gpt" in live.controller.state.jobs)
        _report(client, live, "n0", 2, xid=79)
        ((dry_id,),) = wait_for(
            lambda: _stored(
                db_url, "SELECT id FROM actions WHERE kind = 'restart_job' AND status = 'dry_run'"
            )
        )
        ctl_db_outage.arm(ACTION_INSERT, values=("approve_action",))  # the approval row only
        r = client.post(f"/api/v1/actions/{dry_id}/approve")
        assert r.status_code == 503, r.text
        ctl_db_outage.disarm()
        assert ctl_db_outage.hits == 1 and actuator.restarts() == []
        assert _actions(db_url, f"action:{dry_id}") == []

        r = client.post(f"/api/v1/actions/{dry_id}/approve")
        assert r.status_code == 200, r.text
        assert len(actuator.restarts()) == 1
        assert _actions(db_url, f"action:{dry_id}") == [("approve_action", "succeeded")]
        ((params,),) = _stored(
            db_url, "SELECT params FROM actions WHERE target = :t", t=f"action:{dry_id}"
        )
        carried = (params if isinstance(params, dict) else json.loads(params))["carried_out"]
        assert carried == r.json()["carried_out"] is not None
        again = client.post(f"/api/v1/actions/{dry_id}/approve")
        assert again.status_code == 409 and "approved already" in again.json()["detail"]
        assert len(actuator.restarts()) == 1


def test_policy_isolation_the_database_refuses_is_undone_and_recorded_failed(
    controller_factory: Any, db_url: str, ctl_db_outage: Any
) -> None:
    live, actuator = _start(controller_factory)
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as client:
        for i in range(4):
            _report(client, live, f"n{i}", 0)
        ctl_db_outage.arm(NODE_WRITE)
        _report(client, live, "n1", 1, xid=79)
        # The step's pending row is finished as failed once the isolation was refused.
        wait_for(lambda: ("isolate_node", "failed") in _actions(db_url, "n1"))
        ctl_db_outage.disarm()
        assert _actions(db_url, "n1") == [("isolate_node", "failed")]
        ((outcome,),) = _stored(db_url, "SELECT outcome FROM actions WHERE target = 'n1'")
        assert "not recorded, undone" in outcome
        assert _isolated(client, live, db_url, "n1") is None
        assert _node_calls(actuator, "n1") == ["isolate_node", "release_node"]
        assert ctl_db_outage.hits >= 1
