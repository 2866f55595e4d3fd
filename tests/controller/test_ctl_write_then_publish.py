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

import time
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy import text

from controller.db.session import make_engine


def _stored(db_url: str, sql: str, **params: Any) -> Any:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def _wait(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


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

    with httpx.Client(base_url=live.url, timeout=20) as client:
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
    database answers, stores both and the agent's next reply carries the command."""
    live = controller_factory(power_tick_interval_s=0.1, ingest_flush_interval_s=0.0)
    loop = live.controller.power.loop
    state = live.controller.state
    tree = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 250,  # one GPU at ~300 W: past the brake, every GPU is capped
        "children": [{"name": "p1", "kind": "server", "budget_w": 10_000}],
    }

    def report(client: httpx.Client, seq: int) -> httpx.Response:
        body = ctl_report("p1", seq, gpus=1, samples=1, t0=time.time())
        r = client.post("/api/v1/reports", json=body, headers=live.headers("agent"))
        assert r.status_code == 200, r.text
        return r

    def stored(sql: str) -> int:
        return int(_stored(db_url, sql))

    commands_sql = "SELECT count(*) FROM commands WHERE node_name = 'p1'"
    actions_sql = "SELECT count(*) FROM actions WHERE kind = 'power_cap'"
    with httpx.Client(base_url=live.url, timeout=20) as client:
        report(client, 0)
        ctl_db_outage.arm(r"^\s*INSERT INTO actions")
        r = client.put("/api/v1/power/domains", json=tree, headers=live.headers())
        assert r.status_code == 200, r.text
        report(client, 1)
        _wait(lambda: ctl_db_outage.hits >= 1)
        time.sleep(0.5)  # several ticks
        assert [c for c in state.commands.values() if c.node == "p1"] == []
        assert stored(commands_sql) == 0 and stored(actions_sql) == 0
        _wait(lambda: ctl_db_outage.hits >= 3)  # decided again at later ticks, refused
        assert loop.tracker.open == [] and loop.tracker._targets == {}
        assert report(client, 2).json()["commands"] == []  # nothing delivered

        ctl_db_outage.disarm()
        _wait(lambda: stored(actions_sql) == 1)
        (command,) = [c for c in state.commands.values() if c.node == "p1"]
        assert stored(commands_sql) == 1
        params = _stored(db_url, "SELECT params FROM actions WHERE kind = 'power_cap'")
        assert command.id in str(params)
        assert [e.command_id for e in loop.tracker.open] == [command.id]
        assert list(loop.tracker._targets) == [("p1", 0, "clocks")]
        assert [c["id"] for c in report(client, 3).json()["commands"]] == [command.id]
