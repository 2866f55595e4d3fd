"""The fabric from reporting nodes' labels (``topology_labels``), rebuilt when they change."""

from __future__ import annotations

import time
from typing import Any

import pytest

from controller.errors import StartupError
from tests import http_calls

JOB = "lbl"
LEAF = {"n-0": "tor-a", "n-1": "tor-a", "n-2": "tor-b", "n-3": "tor-b", "n-4": "tor-c"}


def report(live: Any, node: str, ranks: list[int], world: int) -> None:
    rows = [
        {"job": JOB, "rank": r, "world_size": world, "step": 0, "compute_time_s": 1.0,
         "collective_wait_s": 0.1, "step_time_s": 1.1, "gpu_index": k}
        for k, r in enumerate(ranks)
    ]  # fmt: skip
    body = {
        "node": {
            "name": node,
            "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in (0, 1)],
            "labels": {"topology.trainguard.io/nic0": LEAF[node], "zone": "a"},
        },
        "agent_instance": "i1", "seq": 0, "sent_unix_s": time.time(),
        "job": {"steps": rows} if ranks else {}, "samples": [],
    }  # fmt: skip
    with http_calls.client(base_url=live.url, headers=live.headers("agent")) as client:
        assert client.post("/api/v1/reports", json=body).status_code == 200


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_fabric_from_labels_plans_and_follows_new_nodes(controller_factory: Any) -> None:
    live = controller_factory(topology_labels={"spines": 2, "port_speed_gbps": 100})
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=30)
    reply = op.get("/api/v1/topology")
    assert reply.status_code == 409
    assert reply.json()["detail"] == (
        "no fabric from node labels yet: no node carries topology.trainguard.io/nic<k> labels"
    )
    for i, node in enumerate(["n-0", "n-1", "n-2", "n-3"]):
        report(live, node, [2 * i, 2 * i + 1], world=8)
    topo = op.get("/api/v1/topology").json()
    assert topo["name"] == "labels" and topo["nodes"] == 4
    assert topo["switches"] == ["spine-000", "spine-001", "tor-a", "tor-b"]
    reply = op.post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 1}})
    assert reply.status_code == 201, reply.text
    plan = reply.json()
    assert plan["flows"] == 8
    # A node joins on a new leaf: the fabric is rebuilt and the plan re-made on it.
    report(live, "n-4", [], world=8)
    topo = op.get("/api/v1/topology").json()
    assert topo["nodes"] == 5 and "tor-c" in topo["switches"]
    detail = op.get(f"/api/v1/plans/{plan['plan_id']}").json()
    assert detail["version"] == 2
    assert detail["versions"][-1]["trigger"] == "fabric rebuilt from node labels"
    # Restart: the same labels rebuild the same fabric, so the stored plan is restored as is.
    live.restart()
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer:
        again = viewer.get(f"/api/v1/plans/{plan['plan_id']}").json()
    assert again["version"] == 2 and again["source_ports"] == detail["source_ports"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_label_settings_errors(controller_factory: Any, tmp_path: Any) -> None:
    with pytest.raises(StartupError, match=r"^topology_labels.spine: unknown key"):
        controller_factory(topology_labels={"spine": 2})
    with pytest.raises(StartupError, match="not both"):
        controller_factory(topology_labels={"spines": 2}, topology_file=tmp_path / "f.yaml")
