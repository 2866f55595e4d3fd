"""Memory and database never disagree (issue 14): a failed write changes nothing.

At each write path the API drives (report ingest, node isolation, commands, incident
resolution, the power tree) the database is made to fail for real, on SQLite and on
PostgreSQL: either it *refuses* the data (a constraint added to the real table: 4xx, the
client must not retry) or it is *unavailable* (a SQLAlchemy hook makes the statement fail
with the driver's ``OperationalError``: 503 with ``Retry-After``). Each time the API still
serves what the database holds, and the next request works.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import text

from controller.db.session import make_engine
from tests import http_calls
from tests.controller.db_reads import stored as _stored


def _refuse(db_url: str, table: str, column: str, value: str) -> None:
    """Make the real database refuse rows of ``table`` whose ``column`` contains ``value``."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "sqlite":
                for op in ("INSERT", "UPDATE"):
                    conn.execute(
                        text(
                            f"CREATE TRIGGER tg_refuse_{op.lower()} BEFORE {op} ON {table} "
                            f"WHEN instr(coalesce(NEW.{column}, ''), '{value}') > 0 "
                            "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
                        )
                    )
            else:
                conn.execute(
                    text(
                        f"ALTER TABLE {table} ADD CONSTRAINT tg_refuse CHECK "
                        f"(strpos(coalesce({column}, ''), '{value}') = 0) NOT VALID"
                    )
                )
    finally:
        engine.dispose()


@pytest.fixture
def live(controller_factory):  # one controller per database, flushing at once
    return controller_factory(ingest_flush_interval_s=0.0)


def _post(client: httpx.Client, live, path: str, body: Any, role: str = "operator"):
    return client.post(path, json=body, headers=live.headers(role))


def _node(client: httpx.Client, live, name: str) -> dict[str, Any]:
    r = client.get(f"/api/v1/nodes/{name}", headers=live.headers())
    assert r.status_code == 200, r.text
    return r.json()


def test_report_the_database_refuses_or_cannot_take(
    live, db_url, ctl_report, ctl_db_outage
) -> None:
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert (
            _post(client, live, "/api/v1/reports", ctl_report("n1", 0), "agent").status_code == 200
        )
        before = _node(client, live, "n1")

        # Unavailable: 503 + Retry-After, nothing shown, the agent's retry is accepted.
        ctl_db_outage.arm(r"^\s*INSERT INTO nodes")
        moved = ctl_report("n1", 1)
        moved["node"]["hostname"] = "moved.example"
        r = _post(client, live, "/api/v1/reports", moved, "agent")
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert ctl_db_outage.hits >= 1
        after = _node(client, live, "n1")
        assert after["hostname"] == before["hostname"] == "n1.example"
        assert after["last_report_unix_s"] == before["last_report_unix_s"]
        r = _post(client, live, "/api/v1/reports", ctl_ctx := ctl_report("n9", 0), "agent")
        assert r.status_code == 503
        assert client.get("/api/v1/nodes/n9", headers=live.headers()).status_code == 404
        ctl_db_outage.disarm()
        r = _post(client, live, "/api/v1/reports", moved, "agent")
        assert r.status_code == 200 and r.json()["duplicate"] is False
        assert _node(client, live, "n1")["hostname"] == "moved.example"
        assert _post(client, live, "/api/v1/reports", ctl_ctx, "agent").status_code == 200

        # Refused: 4xx (never "retry later"), nothing shown, the node's next reports store.
        _refuse(db_url, "nodes", "hostname", "poison")
        bad = ctl_report("n1", 2)
        bad["node"]["hostname"] = "poison.example"
        r = _post(client, live, "/api/v1/reports", bad, "agent")
        assert r.status_code == 409, r.text
        assert "retry-after" not in r.headers
        assert _node(client, live, "n1")["hostname"] == "moved.example"
        good = ctl_report("n1", 3)
        good["node"]["hostname"] = "fine.example"
        assert _post(client, live, "/api/v1/reports", good, "agent").status_code == 200
        assert _node(client, live, "n1")["hostname"] == "fine.example"
    assert _stored(db_url, "SELECT hostname FROM nodes WHERE name = 'n1'") == "fine.example"
    assert _stored(db_url, "SELECT last_seq FROM agent_cursors WHERE node_name = 'n1'") == 3


def test_isolation_the_database_refuses_leaves_the_node_as_shown(
    live, db_url, ctl_report, ctl_db_outage
) -> None:
    """The known case: the API said "isolated", the database did not, and every later
    report of the node failed because its row could no longer be written."""
    _refuse(db_url, "nodes", "isolated_reason", "forbidden")
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert (
            _post(client, live, "/api/v1/reports", ctl_report("n2", 0), "agent").status_code == 200
        )
        r = _post(client, live, "/api/v1/nodes/n2/isolate", {"reason": "a forbidden reason"})
        assert r.status_code == 409, r.text
        assert _node(client, live, "n2")["isolated_reason"] is None
        assert (
            _post(client, live, "/api/v1/reports", ctl_report("n2", 1), "agent").status_code == 200
        )

        # A NUL byte: PostgreSQL's text refuses it (422 from the database, or from the
        # door's validation); wherever it is refused, the API shows what is stored.
        r = _post(client, live, "/api/v1/nodes/n2/isolate", {"reason": "nul\u0000byte"})
        shown = _node(client, live, "n2")["isolated_reason"]
        assert shown == _stored(db_url, "SELECT isolated_reason FROM nodes WHERE name = 'n2'")
        if db_url.startswith("postgresql"):
            assert r.status_code == 422, r.text
        if shown is not None:
            assert r.status_code == 200
            assert _post(client, live, "/api/v1/nodes/n2/release", None).status_code == 200
        assert (
            _post(client, live, "/api/v1/reports", ctl_report("n2", 2), "agent").status_code == 200
        )

        ctl_db_outage.arm(r"^\s*UPDATE nodes")
        r = _post(client, live, "/api/v1/nodes/n2/isolate", {"reason": "xid 79"})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert _node(client, live, "n2")["isolated_reason"] is None
        ctl_db_outage.disarm()

        assert (
            _post(client, live, "/api/v1/nodes/n2/isolate", {"reason": "xid 79"}).status_code == 200
        )
        assert _node(client, live, "n2")["isolated_reason"] == "xid 79"
        # Reports keep storing, and a row rebuilt from memory keeps the isolation.
        r = _post(client, live, "/api/v1/reports", ctl_report("n2", 3), "agent")
        assert r.status_code == 200 and r.json()["duplicate"] is False
    assert _stored(db_url, "SELECT isolated_reason FROM nodes WHERE name = 'n2'") == "xid 79"
    assert _stored(db_url, "SELECT last_seq FROM agent_cursors WHERE node_name = 'n2'") == 3


def test_command_and_incident_writes_that_fail_change_nothing(
    live, db_url, ctl_report, ctl_db_outage
) -> None:
    fatal = {0: {"xid_events": [{"code": 79}]}}
    with http_calls.client(base_url=live.url, timeout=20) as client:
        body = ctl_report("n3", 0, gpu_overrides=fatal)
        for sample in body["samples"]:
            for event in sample["gpus"][0].get("xid_events", []):
                event["time_unix_s"] = sample["time_unix_s"]
        assert _post(client, live, "/api/v1/reports", body, "agent").status_code == 200
        incidents = client.get("/api/v1/incidents?state=open", headers=live.headers()).json()
        (incident,) = [i for i in incidents["data"] if i["node"] == "n3"]

        # Command: not queued, so never handed to the agent.
        ctl_db_outage.arm(r"^\s*INSERT INTO commands")
        command = {"kind": "set_power_limit", "gpu_index": 1, "limit_w": 500}
        r = _post(client, live, "/api/v1/nodes/n3/commands", command)
        assert r.status_code == 503, r.text
        reply = _post(client, live, "/api/v1/reports", ctl_report("n3", 1), "agent").json()
        assert reply["commands"] == []
        ctl_db_outage.disarm()
        assert _post(client, live, "/api/v1/nodes/n3/commands", command).status_code == 201
        reply = _post(client, live, "/api/v1/reports", ctl_report("n3", 2), "agent").json()
        assert [c["kind"] for c in reply["commands"]] == ["set_power_limit"]

        # Incident resolution: still open in memory and in the database.
        ctl_db_outage.arm(r"^\s*UPDATE incidents")
        r = _post(client, live, f"/api/v1/incidents/{incident['id']}/resolve", None)
        assert r.status_code == 503, r.text
        still = client.get("/api/v1/incidents?state=open", headers=live.headers()).json()
        assert incident["id"] in [i["id"] for i in still["data"]]
        # The resolution would have trusted GPU 0 again; it did not happen, so it is not.
        gpu0 = next(g for g in _node(client, live, "n3")["gpus"] if g["index"] == 0)
        assert gpu0["health"] == "unhealthy"
        ctl_db_outage.disarm()
        r = _post(client, live, f"/api/v1/incidents/{incident['id']}/resolve", None)
        assert r.status_code == 200 and r.json()["state"] == "resolved"
        gpu0 = next(g for g in _node(client, live, "n3")["gpus"] if g["index"] == 0)
        assert gpu0["health"] == "healthy"
    assert _stored(db_url, "SELECT count(*) FROM commands WHERE node_name = 'n3'") == 1
    state = _stored(db_url, "SELECT state FROM incidents WHERE id = :i", i=incident["id"])
    assert state == "resolved"


def test_power_tree_write_that_fails_changes_nothing(live, db_url, ctl_db_outage) -> None:
    tree = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 3000,
        "children": [{"name": "n4", "kind": "server", "budget_w": 2000}],
    }
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert client.put("/api/v1/power/domains", json=tree, headers=live.headers()).is_success
        bigger = {**tree, "budget_w": 4000}
        ctl_db_outage.arm(r"power_domains")
        r = client.put("/api/v1/power/domains", json=bigger, headers=live.headers())
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        shown = client.get("/api/v1/power/domains", headers=live.headers()).json()
        assert shown["tree"]["budget_w"] == 3000
        ctl_db_outage.disarm()
        r = client.put("/api/v1/power/domains", json=bigger, headers=live.headers())
        assert r.status_code == 200 and r.json()["tree"]["budget_w"] == 4000
    budget = _stored(db_url, "SELECT provisioned_power_w FROM power_domains WHERE name = 'row-a'")
    assert budget == 4000
