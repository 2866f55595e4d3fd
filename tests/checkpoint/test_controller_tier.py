"""Issue 19: the controller keeps each checkpoint event's tier (``local`` disk or
``object_store``), on SQLite and PostgreSQL, from the agent's report to the API, and rows of
a database migrated from before the column read as ``local``."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from controller.db.migrate import upgrade
from controller.db.models import Checkpoint
from controller.db.session import make_engine
from controller.services.remediation.history import newest_committed_before
from tests import http_calls


def _event(step: int, kind: str, tier: str, t: float, **extra: Any) -> dict[str, Any]:
    return {"job": "gpt", "rank": 0, "step": step, "kind": kind, "tier": tier,
            "time_unix_s": t, **extra}  # fmt: skip


def test_tier_goes_from_the_report_to_the_api(live_controller) -> None:  # type: ignore[no-untyped-def]
    t = time.time()
    events = [
        _event(4, "durable", "local", t - 5, duration_s=0.5),
        _event(4, "committed", "local", t - 4),
        _event(4, "upload_pending", "object_store", t - 3),
        _event(4, "uploaded", "object_store", t - 1, duration_s=4.0),
    ]
    body = {
        "node": {"name": "n0", "gpus": []},
        "agent_instance": "i1",
        "seq": 0,
        "sent_unix_s": t,
        "job": {"checkpoints": events},
    }
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("agent"))
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while True:
            got = client.get(
                "/api/v1/jobs/gpt/checkpoints", headers=live_controller.headers("viewer")
            )
            if got.status_code == 200 and got.json()["count"] == 4:
                break
            assert time.monotonic() < deadline, got.text
            time.sleep(0.1)
    rows = got.json()["data"]  # newest first
    assert [(row["kind"], row["tier"]) for row in rows] == [
        ("uploaded", "object_store"),
        ("upload_pending", "object_store"),
        ("committed", "local"),
        ("durable", "local"),
    ]
    assert rows[0]["duration_s"] == 4.0


def test_rows_from_before_the_column_read_as_local(db_url: str) -> None:
    """A row stored at revision 0004, and one inserted by the previous controller (which
    does not name the column) on the new schema, read as ``local``. The rollback's "newest
    committed below" counts the commits of both tiers (node-local roots commit only in the
    object store) and nothing that is not a commit (``uploaded``)."""
    old_insert = (
        "INSERT INTO checkpoints (job_name, rank, node_name, step, kind, path, error,"
        " time_unix_s) VALUES ('gpt', 0, 'n0', {step}, 'committed', '', '', 1.0)"
    )
    assert upgrade(db_url, "0004") == "0004"
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO jobs (name, world_size, first_seen_unix_s, last_seen_unix_s)"
                " VALUES ('gpt', 1, 1.0, 1.0)"
            )
            conn.exec_driver_sql(old_insert.format(step=10))
        assert upgrade(db_url, "0005") == "0005"
        with engine.begin() as conn:
            conn.exec_driver_sql(old_insert.format(step=20))
            row = {"job_name": "gpt", "rank": 0, "node_name": "n0", "step": 30,
                   "kind": "committed", "tier": "object_store", "time_unix_s": 3.0}  # fmt: skip
            uploaded = {**row, "step": 40, "kind": "uploaded"}
            conn.execute(insert(Checkpoint.__table__), [row, uploaded])  # type: ignore[arg-type]
        with engine.connect() as conn:
            tiers = conn.execute(
                select(Checkpoint.step, Checkpoint.tier).order_by(Checkpoint.step)
            ).all()
        assert [tuple(t) for t in tiers] == [
            (10, "local"), (20, "local"), (30, "object_store"), (40, "object_store")
        ]  # fmt: skip
        with Session(engine) as session:
            assert newest_committed_before(session, "gpt", 50) == 30
            assert newest_committed_before(session, "gpt", 30) == 20
            assert newest_committed_before(session, "gpt", 20) == 10
    finally:
        engine.dispose()
