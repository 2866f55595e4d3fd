"""Write, then publish, where memory once ran ahead (issue 14), on SQLite and PostgreSQL.

Three state changes that used to be shown before they were stored: a GPU's first
uncorrectable-ECC baseline (now set with the report and written in its group commit), a
power cap's command and its ``power_cap`` action (one transaction, then the policy's
target), and a slow-link re-plan with its ``traffic_replan`` action (one transaction, then
the new plan version). The database is made to fail at each write (``ctl_db_outage``: the
driver's own ``OperationalError`` inside the real transaction); memory then equals the
database, and once the database answers again the next report or tick stores the change.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests import http_calls
from tests.controller.db_reads import stored as _stored
from tests.controller.db_reads import stored_column as _rows
from tests.traffic.fabrics import lab_fabric_file
from tests.waiting import wait_for


def _as_dict(value: Any) -> dict[str, Any]:
    """A JSON column as read back (a dict on PostgreSQL, text on SQLite)."""
    return dict(json.loads(value) if isinstance(value, str) else value)


def test_first_ecc_baseline_is_stored_with_its_report(
    live_controller, db_url, ctl_report, ctl_db_outage
) -> None:
    """A GPU's first uncorrectable-ECC value (no fault) is the baseline the next value is
    judged against: it goes with the report's own commit, so a commit that fails answers
    503 and leaves no baseline in memory or database, and the agent's retry stores both."""
    live = live_controller
    nodes = live.controller.state.nodes

    def post(client: httpx.Client, seq: int, value: int | None) -> httpx.Response:
        body = ctl_report("w11", seq, gpus=1, gpu_overrides={0: {"ecc_uncorrected_total": value}})
        return client.post("/api/v1/reports", json=body, headers=live.headers("agent"))

    def stored() -> Any:
        return _stored(
            db_url,
            "SELECT ecc_uncorrected_total FROM gpus WHERE node_name = 'w11' AND \"index\" = 0",
        )

    def shown() -> int | None:
        return nodes["w11"].gpus[0].ecc_uncorrected_total

    with http_calls.client(base_url=live.url, timeout=20) as client:
        # The GPU is known and stored, without a counter value yet.
        assert post(client, 0, None).status_code == 200
        assert shown() is None and stored() is None
        ctl_db_outage.arm(r"^\s*INSERT INTO gpus", values=("'w11'",))
        r = post(client, 1, 7)
        assert r.status_code == 503, r.text
        assert ctl_db_outage.hits >= 1
        time.sleep(0.3)  # nothing may show the value after the failure either
        assert shown() is None and stored() is None
        ctl_db_outage.disarm()
        assert post(client, 1, 7).status_code == 200  # the agent's retry
        assert shown() == 7 and stored() == 7
        incidents = client.get("/api/v1/incidents", headers=live.headers()).json()["data"]
        assert [i for i in incidents if i["node"] == "w11"] == []  # a baseline, not a fault


def test_power_cap_and_its_action_are_stored_together_or_not_at_all(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    """A cap the power policy decides is one transaction: its command and its
    ``power_cap`` action row. The action row refused, no command is queued, stored or
    delivered and the loop tracks no target; the next tick decides again and, once the
    database answers, stores both and the agent's next reply carries the commands. Two
    GPUs to cap: the second, not tried once the first found the database away, is
    withdrawn from the policy too and sent later."""
    live = controller_factory(power_tick_interval_s=0.1, ingest_flush_interval_s=0.0)
    loop = live.controller.power.loop
    state = live.controller.state
    tree = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 500,  # two GPUs at ~300 W: past the brake, every GPU is capped
        "children": [{"name": "p1", "kind": "server", "budget_w": 10_000}],
    }

    def report(client: httpx.Client, seq: int) -> httpx.Response:
        body = ctl_report("p1", seq, gpus=2, samples=1, t0=time.time())
        r = client.post("/api/v1/reports", json=body, headers=live.headers("agent"))
        assert r.status_code == 200, r.text
        return r

    def stored(sql: str) -> int:
        return int(_stored(db_url, sql))

    commands_sql = "SELECT count(*) FROM commands WHERE node_name = 'p1'"
    actions_sql = "SELECT count(*) FROM actions WHERE kind = 'power_cap'"
    with http_calls.client(base_url=live.url, timeout=20) as client:
        report(client, 0)
        ctl_db_outage.arm(r"^\s*INSERT INTO actions")
        r = client.put("/api/v1/power/domains", json=tree, headers=live.headers())
        assert r.status_code == 200, r.text
        report(client, 1)
        wait_for(lambda: ctl_db_outage.hits >= 1)
        time.sleep(0.5)  # several ticks
        assert [c for c in state.commands.values() if c.node == "p1"] == []
        assert stored(commands_sql) == 0 and stored(actions_sql) == 0
        wait_for(lambda: ctl_db_outage.hits >= 3)  # decided again at later ticks, refused
        assert loop.tracker.open == [] and loop.tracker._targets == {}
        assert report(client, 2).json()["commands"] == []  # nothing delivered

        ctl_db_outage.disarm()
        wait_for(lambda: stored(actions_sql) == 2)
        wait_for(lambda: len([c for c in state.commands.values() if c.node == "p1"]) == 2)
        ids = {c.id for c in state.commands.values() if c.node == "p1"}
        assert stored(commands_sql) == 2
        params = _rows(db_url, "SELECT params FROM actions WHERE kind = 'power_cap'")
        assert {_as_dict(p)["command_id"] for p in params} == ids
        assert {e.command_id for e in loop.tracker.open} == ids
        assert sorted(loop.tracker._targets) == [("p1", 0, "clocks"), ("p1", 1, "clocks")]
        assert {c["id"] for c in report(client, 3).json()["commands"]} == ids


def test_power_action_update_that_fails_is_written_at_a_later_tick(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    """The cap's ack finishes its action: the update refused, the loop does not mark the
    action finished (the row still says ``pending``), and a later tick writes it, with no
    new report."""
    live = controller_factory(power_tick_interval_s=0.1, ingest_flush_interval_s=0.0)
    loop = live.controller.power.loop
    state = live.controller.state
    tree = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 250,
        "children": [{"name": "p2", "kind": "server", "budget_w": 10_000}],
    }

    def report(client: httpx.Client, seq: int, **extra: Any) -> httpx.Response:
        body = ctl_report("p2", seq, gpus=1, samples=1, t0=time.time(), **extra)
        r = client.post("/api/v1/reports", json=body, headers=live.headers("agent"))
        assert r.status_code == 200, r.text
        return r

    def status() -> Any:
        return _stored(db_url, "SELECT status FROM actions WHERE kind = 'power_cap'")

    with http_calls.client(base_url=live.url, timeout=20) as client:
        report(client, 0)
        r = client.put("/api/v1/power/domains", json=tree, headers=live.headers())
        assert r.status_code == 200, r.text
        report(client, 1)
        wait_for(lambda: status() == "pending")
        wait_for(lambda: any(e.node == "p2" for e in loop.tracker.open))
        (entry,) = loop.tracker.open
        command = state.commands[str(entry.command_id)]

        ctl_db_outage.arm(r"^\s*UPDATE actions")
        ack = {"command_id": command.id, "status": "succeeded", "finished_unix_s": time.time()}
        report(client, 3, command_acks=[ack])
        wait_for(lambda: ctl_db_outage.hits >= 1)
        time.sleep(0.3)  # several ticks
        assert state.commands[command.id].status == "succeeded"
        assert status() == "pending" and not entry.command_done
        wait_for(lambda: ctl_db_outage.hits >= 2)  # tried again
        ctl_db_outage.disarm()
        wait_for(lambda: status() == "succeeded")  # a later tick; no new report
        wait_for(lambda: entry.command_done)
        params = _stored(db_url, "SELECT params FROM actions WHERE kind = 'power_cap'")
        assert "command_latency_s" in str(params)


def test_slow_link_replan_and_its_action_are_stored_together_or_not_at_all(
    controller_factory, db_url, ctl_db_outage, tmp_path
) -> None:
    """A NIC's port-down incident re-plans around the NIC's links; the new plan version,
    the link states and the ``traffic_replan`` action are one transaction. The action row
    refused, nothing of the re-plan is stored or shown (version, link states and the
    fabric's health as before); the next change works."""
    live = controller_factory(
        topology_file=lab_fabric_file(tmp_path, "tf"), ingest_flush_interval_s=0.0
    )
    traffic = live.controller.traffic
    nics = [{"device": "mlx5_0", "port": 1, "pci_bus_id": "0000:1a:00.0"}]

    def report(client: httpx.Client, k: int, seq: int, events: list[Any] | None = None) -> None:
        ranks = [2 * k, 2 * k + 1]
        steps = [
            {"job": "llm", "rank": r, "world_size": 8, "step": seq, "compute_time_s": 1.0,
             "collective_wait_s": 0.05, "step_time_s": 1.05, "gpu_index": i}
            for i, r in enumerate(ranks)
        ]  # fmt: skip
        now = time.time()
        gpus = [{"index": i, "uuid": f"tf-{k}-g{i}"} for i in (0, 1)]
        body = {
            "node": {"name": f"tf-{k}", "gpus": gpus, "nics": nics},
            "agent_instance": "i1", "seq": seq, "sent_unix_s": now,
            "job": {"steps": steps},
            "samples": [{"time_unix_s": now, "gpus": [], "events": events or []}],
        }  # fmt: skip
        r = client.post("/api/v1/reports", json=body, headers=live.headers("agent"))
        assert r.status_code == 200, r.text

    def stored(sql: str) -> int:
        return int(_stored(db_url, sql))

    with http_calls.client(base_url=live.url, timeout=30) as client:
        for k in range(4):
            report(client, k, 0)
        r = client.post(
            "/api/v1/plans", json={"job": "llm", "layout": {"tp": 1}}, headers=live.headers()
        )
        assert r.status_code == 201, r.text
        plan_id = r.json()["plan_id"]

        def version_shown() -> int:
            got = client.get(f"/api/v1/plans/{plan_id}", headers=live.headers())
            return int(got.json()["version"])

        versions_sql = f"SELECT max(version) FROM traffic_plans WHERE plan_id = '{plan_id}'"
        actions_sql = "SELECT count(*) FROM actions WHERE kind = 'traffic_replan'"
        health = traffic.topology.health.copy()
        ctl_db_outage.arm(r"^\s*INSERT INTO actions")
        port_down = {"kind": "nic_port_down", "time_unix_s": time.time(), "device": "mlx5_0",
                     "port": 1, "detail": "link_downed +3"}  # fmt: skip
        report(client, 3, 1, events=[port_down])
        wait_for(lambda: ctl_db_outage.hits >= 2)  # the re-plan, then its "failed" record
        time.sleep(0.2)
        assert version_shown() == stored(versions_sql) == 1
        assert stored("SELECT count(*) FROM traffic_links") == 0 and stored(actions_sql) == 0
        assert traffic.link_factors == {} and (traffic.topology.health == health).all()
        incidents = client.get("/api/v1/incidents?kind=hw_degraded", headers=live.headers())
        assert [i["node"] for i in incidents.json()["data"]] == ["tf-3"]  # found, not acted on

        ctl_db_outage.disarm()
        r = client.post(
            "/api/v1/topology/links/tf-3/nic0/p0->tor-b/state",
            json={"state": "slow", "capacity_factor": 0.25},
            headers=live.headers(),
        )
        assert r.status_code == 200, r.text
        assert version_shown() == stored(versions_sql) == 2
