"""The planner inside a live controller: placement from reports, plans over the API,
link changes, restart, bad input and the ``plan list/get`` CLI."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controller.errors import StartupError
from tests import http_calls
from trainguard.cli.app import run

JOB = "llm"
#: Scheduler order: ranks 0-1 on tg-0, 2-3 on tg-2, 4-5 on tg-1, 6-7 on tg-3, so the ring as
#: launched crosses leaves at every node boundary; the plan's order crosses twice.
PLACEMENT = {"tg-0": [0, 1], "tg-2": [2, 3], "tg-1": [4, 5], "tg-3": [6, 7]}
DOWN = ("tor-a->spine-0", "spine-0->tor-a")


def report_steps(live: Any, seq: int, step: int = 0) -> None:
    with http_calls.client(base_url=live.url, headers=live.headers("agent"), timeout=10) as client:
        for node, ranks in PLACEMENT.items():
            rows = [
                {"job": JOB, "rank": r, "world_size": 8, "step": step, "compute_time_s": 1.0,
                 "collective_wait_s": 0.05, "step_time_s": 1.05, "gpu_index": k}
                for k, r in enumerate(ranks)
            ]  # fmt: skip
            gpus = [{"index": i, "uuid": f"{node}-g{i}"} for i in (0, 1)]
            body = {
                "node": {"name": node, "gpus": gpus},
                "agent_instance": "i1", "seq": seq, "sent_unix_s": time.time(),
                "job": {"steps": rows}, "samples": [],
            }  # fmt: skip
            assert client.post("/api/v1/reports", json=body).status_code == 200


def flow_paths(plan: dict[str, Any]) -> dict[tuple[Any, ...], list[str]]:
    """Every queue pair's path, keyed by what identifies the connection."""
    return {
        (node, q["nic"], q["peer"], q["peer_nic"], q["collective"], q["channel"], q["qp"]): q[
            "path"
        ]
        for node, qps in plan["source_ports"]["nodes"].items()
        for q in qps
    }


@pytest.fixture
def planned(
    controller_factory: Any, traffic_fabric_file: Path
) -> tuple[Any, httpx.Client, dict[str, Any]]:
    live = controller_factory(topology_file=traffic_fabric_file)
    report_steps(live, seq=0)
    client = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=30)
    reply = client.post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 1, "channels": 2}})
    assert reply.status_code == 201, reply.text
    return live, client, reply.json()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_plan_from_reported_placement_then_link_down_moves_only_affected_flows(
    planned: tuple[Any, httpx.Client, dict[str, Any]],
) -> None:
    _live, client, plan = planned
    assert plan["version"] == 1 and plan["job"] == JOB
    # The ring order groups nodes by leaf: tg-0, tg-1 (tor-a), then tg-2, tg-3 (tor-b).
    assert [o["node"] for o in plan["launcher_order"]] == ["tg-0", "tg-1", "tg-2", "tg-3"]
    assert plan["nccl_env"]["NCCL_MAX_NCHANNELS"] == "2"
    assert plan["stats"]["max_link_load_bytes"] > 0
    # 8 flows: small enough for the exact search, which proves the plan optimal
    assert plan["proven_optimal"] is True and plan["stats"]["proven_optimal"] is True
    before = flow_paths(plan)
    assert len(before) == plan["flows"] == 8  # 4 ring edges between nodes x 2 channels
    on_down = {k for k, p in before.items() if set(p) & set(DOWN)}
    assert on_down, "the planner spreads channels over both spines"
    for q in plan["source_ports"]["nodes"]["tg-0"]:
        assert 49152 <= q["udp_sport"] <= 65535

    reply = client.post("/api/v1/topology/links/tor-a--spine-0/state", json={"state": "down"})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    (changed,) = result["plans"]
    assert changed["version"] == 2 and changed["moved_flows"] == len(on_down)
    assert result["replan_ms"] > 0
    after = flow_paths(client.get(f"/api/v1/plans/{plan['plan_id']}").json())
    moved = {k for k in before if before[k] != after[k]}
    assert moved == on_down  # exactly the flows that used the dead link
    assert not any(set(p) & set(DOWN) for p in after.values())
    detail = client.get(f"/api/v1/plans/{plan['plan_id']}").json()
    assert [v["version"] for v in detail["versions"]] == [1, 2]
    assert detail["versions"][1]["changes"] == [{"link": "tor-a--spine-0", "health": 0.0}]
    topo = client.get("/api/v1/topology").json()
    assert sorted(topo["down_links"]) == sorted(DOWN) and topo["plans"] == 1

    # Healing a link no plan uses any more moves no flow, but the equal-cost groups at
    # tor-a and spine-0 grow again, so flows through them keep their paths with new ports.
    reply = client.post("/api/v1/topology/links/tor-a--spine-0/state", json={"state": "up"})
    assert reply.status_code == 200
    (healed,) = reply.json()["plans"]
    assert healed["version"] == 3 and healed["moved_flows"] == 0
    assert healed["reported_flows"] > 0
    assert flow_paths(client.get(f"/api/v1/plans/{plan['plan_id']}").json()) == after
    assert client.get("/api/v1/topology").json()["down_links"] == []


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_plans_and_link_states_survive_a_restart(
    planned: tuple[Any, httpx.Client, dict[str, Any]],
) -> None:
    live, client, plan = planned
    reply = client.post("/api/v1/topology/links/tor-b--spine-1/state", json={"state": "down"})
    assert reply.status_code == 200
    before = client.get(f"/api/v1/plans/{plan['plan_id']}").json()
    live.restart()
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer:
        after = viewer.get(f"/api/v1/plans/{plan['plan_id']}").json()
        assert viewer.get("/api/v1/plans").json()["count"] == 1
        topo = viewer.get("/api/v1/topology").json()
    assert after["version"] == before["version"] == 2
    assert after["proven_optimal"] == before["proven_optimal"]
    assert after["source_ports"] == before["source_ports"]
    assert after["versions"] == before["versions"]
    assert sorted(topo["down_links"]) == ["spine-1->tor-b", "tor-b->spine-1"]
    # The restored plan is live: the next change re-plans from it.
    with http_calls.client(base_url=live.url, headers=live.headers("operator")) as op:
        reply = op.post(
            "/api/v1/topology/links/tor-a--spine-0/state",
            json={"state": "slow", "capacity_factor": 0.5},
        )
    assert reply.status_code == 200 and reply.json()["plans"][0]["version"] == 3


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_proof_of_optimality_survives_a_restart(
    planned: tuple[Any, httpx.Client, dict[str, Any]],
) -> None:
    live, _client, plan = planned
    assert plan["proven_optimal"] is True
    live.restart()
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer:
        (restored,) = viewer.get("/api/v1/plans").json()["data"]
    assert restored["plan_id"] == plan["plan_id"] and restored["proven_optimal"] is True


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_changed_fabric_file_replans_stored_plans_at_start(
    planned: tuple[Any, httpx.Client, dict[str, Any]], traffic_fabric_file: Path
) -> None:
    live, _client, plan = planned
    live.stop()
    doc = yaml.safe_load(traffic_fabric_file.read_text())
    doc["switches"].append({"name": "spine-2", "tier": 2})
    doc["cables"] += [{"lower": leaf, "upper": "spine-2"} for leaf in ("tor-a", "tor-b")]
    traffic_fabric_file.write_text(yaml.safe_dump(doc))
    live.start()
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer:
        after = viewer.get(f"/api/v1/plans/{plan['plan_id']}").json()
        assert "spine-2" in viewer.get("/api/v1/topology").json()["switches"]
    assert after["version"] == 2 and after["parent_version"] == 1
    assert after["versions"][-1]["trigger"] == "restart: stored paths no longer fit the fabric"
    assert after["flows"] == plan["flows"] and len(flow_paths(after)) == plan["flows"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_bad_input_is_a_one_line_4xx_naming_the_field(
    planned: tuple[Any, httpx.Client, dict[str, Any]],
) -> None:
    live, client, plan = planned

    def detail(reply: httpx.Response, status: int) -> str:
        assert reply.status_code == status, reply.text
        text: str = reply.json()["detail"]
        assert "\n" not in text
        return text

    post = client.post
    assert "nope" in detail(post("/api/v1/plans", json={"job": "nope"}), 404)
    assert "body.layout.tp" in detail(
        post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 0}}), 422
    )
    assert "body.layout" in detail(
        post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 3}}), 422
    )
    assert "replace=true" in detail(post("/api/v1/plans", json={"job": JOB}), 409)
    again = post("/api/v1/plans", json={"job": JOB, "replace": True, "layout": {"channels": 4}})
    assert again.status_code == 201 and again.json()["version"] == 2
    assert again.json()["plan_id"] == plan["plan_id"]
    links = "/api/v1/topology/links"
    assert "unknown link" in detail(
        post(f"{links}/tor-a--tor-z/state", json={"state": "down"}), 404
    )
    assert "capacity_factor" in detail(
        post(f"{links}/tor-a--spine-0/state", json={"state": "slow"}), 422
    )
    assert "body.state" in detail(
        post(f"{links}/tor-a--spine-0/state", json={"state": "gone"}), 422
    )
    # Cutting tg-0's only cable partitions the fabric: refused, and nothing changes.
    assert "no live path from tg-0/nic0" in detail(
        post(f"{links}/tg-0/nic0/p0--tor-a/state", json={"state": "down"}), 409
    )
    assert client.get("/api/v1/topology").json()["down_links"] == []
    assert "not found" in detail(client.get("/api/v1/plans/nope"), 404)
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer:
        assert viewer.post("/api/v1/plans", json={"job": JOB}).status_code == 403


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_topology_setting_errors(controller_factory: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nswitches: [{name: t, tier: 1}]\n"
        "nodes: [{name: n, nics: [{ports: [{leaf: zz}]}]}]\n"
    )
    with pytest.raises(
        StartupError, match=r"^topology_file .*bad.yaml: nodes.0.nics.0.ports.0.leaf"
    ):
        controller_factory(topology_file=bad)
    live = controller_factory()  # no fabric: planning is off, said plainly
    with http_calls.client(base_url=live.url, headers=live.headers("operator")) as client:
        reply = client.get("/api/v1/topology")
        assert reply.status_code == 409 and "topology_file" in reply.json()["detail"]
        assert client.get("/api/v1/plans").json() == {"data": [], "count": 0}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_plan_list_and_get(
    planned: tuple[Any, httpx.Client, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live, client, plan = planned
    client.post("/api/v1/topology/links/tor-a--spine-0/state", json={"state": "down"})
    monkeypatch.setenv("TRAINGUARD_SERVER", live.url)
    monkeypatch.setenv("TRAINGUARD_TOKEN", live.viewer_token)

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = run(list(args), prog_name="trainguard")
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = cli("plan", "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["ID", "JOB", "VERSION", "NODES", "FLOWS", "MAX-LINK-MS", "AGE"]
    assert row.split()[:5] == [plan["plan_id"], JOB, "2", "4", "8"]
    code, out, _ = cli("plan", "list", "-o", "wide")
    header, row = out.splitlines()
    assert header.split()[-1] == "OPTIMAL" and row.split()[-1] == "-"  # re-planned: no proof
    code, out, _ = cli("plan", "list", "-o", "name")
    assert out.strip() == f"plan/{plan['plan_id']}"
    code, out, _ = cli("plan", "get", plan["plan_id"])
    assert code == 0
    assert f"ID:             {plan['plan_id']}" in out
    assert "Optimal:        not proven" in out
    assert "NODE-RANK   NODE   FIRST-RANK" in out and "1           tg-1   2" in out
    assert "tor-a--spine-0=0.0" in out
    code, out, _ = cli("plan", "get", plan["plan_id"], "-o", "wide")
    assert "UDP-SPORT" in out and "tg-1/nic0/p0->tor-a" in out
    code, _, err = cli("plan", "get", "nope")
    assert code != 0 and err.strip().endswith('plan "nope" not found')
