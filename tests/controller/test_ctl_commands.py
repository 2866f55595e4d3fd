"""Commands round trip: queue -> delivered in a ReportReply -> acked -> status."""

from __future__ import annotations

import time

import pytest

from tests import http_calls


def test_command_round_trip(live_controller, ctl_report) -> None:
    agent, operator = live_controller.headers("agent"), live_controller.headers("operator")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        r = client.post(
            "/api/v1/nodes/node-c/commands",
            json={"kind": "set_power_limit", "gpu_index": 2, "limit_w": 350},
            headers=operator,
        )
        assert r.status_code == 404  # no such node yet

        assert client.post("/api/v1/reports", json=ctl_report("node-c", 0), headers=agent)
        r = client.post(
            "/api/v1/nodes/node-c/commands",
            json={"kind": "set_power_limit", "gpu_index": 2, "limit_w": 350, "reason": "cap"},
            headers=operator,
        )
        assert r.status_code == 201, r.text
        created = r.json()
        assert created["status"] == "pending" and created["node"] == "node-c"
        assert created["params"]["limit_w"] == 350 and created["params"]["gpu_index"] == 2
        command_id = created["id"]

        reply = client.post("/api/v1/reports", json=ctl_report("node-c", 1), headers=agent).json()
        assert [c["id"] for c in reply["commands"]] == [command_id]
        assert reply["commands"][0] == {
            **reply["commands"][0],
            "kind": "set_power_limit",
            "gpu_index": 2,
            "limit_w": 350.0,
            "reason": "cap",
        }
        listed = client.get("/api/v1/commands", params={"node": "node-c"}, headers=operator)
        assert listed.json()["data"][0]["status"] == "sent"

        # Delivered once: the next reply has nothing.
        reply = client.post("/api/v1/reports", json=ctl_report("node-c", 2), headers=agent).json()
        assert reply["commands"] == []

        ack = {"command_id": command_id, "status": "failed", "reason": "NVML: no permission"}
        body = ctl_report("node-c", 3, command_acks=[ack])
        assert client.post("/api/v1/reports", json=body, headers=agent).status_code == 200
        final = client.get("/api/v1/commands", params={"status": "failed"}, headers=operator).json()
        assert final["count"] == 1
        assert final["data"][0]["reason"] == "NVML: no permission"
        assert final["data"][0]["finished_unix_s"] is not None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_command_validation(live_controller, ctl_report) -> None:
    operator = live_controller.headers("operator")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        client.post(
            "/api/v1/reports",
            json=ctl_report("node-v", 0),
            headers=live_controller.headers("agent"),
        )
        r = client.post("/api/v1/nodes/node-v/commands", json={"kind": "explode"}, headers=operator)
        assert r.status_code == 422 and r.json()["detail"].startswith("body")
        r = client.post(
            "/api/v1/nodes/node-v/commands",
            json={"kind": "set_power_limit", "gpu_index": 12, "limit_w": 300},
            headers=operator,
        )
        assert r.status_code == 422 and "has no GPU 12" in r.json()["detail"]
        r = client.post(
            "/api/v1/nodes/node-v/commands",
            json={"kind": "set_power_limit", "gpu_index": 1, "limit_w": 0},
            headers=operator,
        )
        assert r.status_code == 422 and "limit_w" in r.json()["detail"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_unacknowledged_commands_expire(controller_factory, ctl_report) -> None:
    live = controller_factory(command_expire_after_s=0.4)
    with http_calls.client(base_url=live.url, timeout=10) as client:
        client.post("/api/v1/reports", json=ctl_report("node-e", 0), headers=live.headers("agent"))
        r = client.post(
            "/api/v1/nodes/node-e/commands",
            json={"kind": "job_checkpoint", "job": "llama"},
            headers=live.headers(),
        )
        command_id = r.json()["id"]
        deadline = time.monotonic() + 10
        while True:
            listed = client.get("/api/v1/commands", headers=live.headers()).json()["data"]
            if listed[0]["status"] == "expired":
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.1)
        assert listed[0]["id"] == command_id
        assert "never delivered" in listed[0]["reason"]
        # An expired command is not delivered any more.
        reply = client.post(
            "/api/v1/reports", json=ctl_report("node-e", 1), headers=live.headers("agent")
        ).json()
        assert reply["commands"] == []


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_pending_command_survives_restart(live_controller, ctl_report) -> None:
    agent = live_controller.headers("agent")
    http_calls.post(
        f"{live_controller.url}/api/v1/reports", json=ctl_report("node-p", 0), headers=agent
    )
    created = http_calls.post(
        f"{live_controller.url}/api/v1/nodes/node-p/commands",
        json={"kind": "unlock_clocks", "gpu_index": 0},
        headers=live_controller.headers(),
    ).json()
    live_controller.restart()
    reply = http_calls.post(
        f"{live_controller.url}/api/v1/reports", json=ctl_report("node-p", 1), headers=agent
    ).json()
    assert [c["id"] for c in reply["commands"]] == [created["id"]]
