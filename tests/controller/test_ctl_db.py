"""Schema migrations, engine settings, and what happens when the database says no."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from controller.db.migrate import (
    SchemaTooNew,
    alembic_config,
    current_revision,
    head_revision,
    upgrade,
)
from controller.db.models import Base
from controller.db.session import make_engine
from controller.errors import BadConfig, NotMigrated
from controller.runtime import prepare_database
from controller.settings import ControllerSettings
from tests import http_calls

TOKENS = [{"name": "ops", "role": "operator", "token": "o" * 20}]


def test_migrations_from_empty_match_models(db_url: str) -> None:
    assert upgrade(db_url) == head_revision() == "0006"
    assert upgrade(db_url) == "0006"  # idempotent
    command.check(alembic_config(db_url))  # `alembic check`: no new upgrade ops to generate
    engine = make_engine(db_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert {
            "nodes", "gpus", "jobs", "ranks", "incidents", "actions", "commands",
            "checkpoints", "power_domains", "gpu_history", "agent_cursors",
            "traffic_plans", "traffic_links", "agent_credentials",
        } <= tables  # fmt: skip
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_concurrent_upgrades_all_succeed(db_url: str, cli_zygote: Any, tmp_path: Path) -> None:
    """Two controller pods' migration init containers (``trainguard db upgrade``) start
    together: one migrates, the others wait and find the head. Unserialized, the losers
    failed with ``DuplicateTable`` / ``table ... already exists`` / ``database is locked``
    on most runs of this test. (Forked from the CLI zygote, the four start within
    milliseconds of each other, not after a second of imports each.)"""
    cmd = ["-m", "trainguard.cli", "db", "upgrade", "--database-url", db_url]
    files = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(4)]
    procs = [
        cli_zygote.spawn(cmd, env=dict(os.environ), stdout=out, stderr=err) for out, err in files
    ]
    codes = [p.wait(timeout=120) for p in procs]
    for rc, (out, err) in zip(codes, files, strict=True):
        assert rc == 0, err.read_text()[-2000:]
        assert out.read_text().strip().endswith(f"is at revision {head_revision()}")
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
        assert [v for (v,) in versions] == [head_revision()]
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_sqlite_pragmas(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 1000
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_postgres_refuses_to_start_unmigrated(db_url: str) -> None:
    settings = ControllerSettings(database_url=db_url, tokens=TOKENS)
    with pytest.raises(NotMigrated, match="trainguard db upgrade"):
        prepare_database(settings)
    upgrade(db_url)
    prepare_database(settings)  # now fine


def _stamp(db_url: str, revision: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    finally:
        engine.dispose()


def test_replica_accepts_schema_at_or_past_its_head(db_url: str) -> None:
    """Issue 22: during a rollout the new release migrates first; an old replica that
    restarts then finds a revision it does not know (newer) and must start, not crash-loop.
    A schema behind head is still refused on PostgreSQL (migrated in place on SQLite)."""
    settings = ControllerSettings(database_url=db_url, tokens=TOKENS)
    upgrade(db_url)
    prepare_database(settings)  # at head
    _stamp(db_url, "9999_from_a_newer_release")
    prepare_database(settings)  # past head: accepted, left as it is
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == "9999_from_a_newer_release"
    finally:
        engine.dispose()
    _stamp(db_url, head_revision())
    command.downgrade(alembic_config(db_url), "0003")
    if db_url.startswith("postgresql"):
        with pytest.raises(NotMigrated, match=r"not at revision 0006.*trainguard db upgrade"):
            prepare_database(settings)
    else:
        prepare_database(settings)
        engine = make_engine(db_url)
        try:
            assert current_revision(engine) == head_revision()
        finally:
            engine.dispose()


def test_upgrade_refuses_a_schema_from_a_newer_release_plainly(db_url: str) -> None:
    """Alembic's "Can't locate revision identified by ..." does not say what to do."""
    upgrade(db_url)
    _stamp(db_url, "9999_future")
    with pytest.raises(SchemaTooNew) as refused:
        upgrade(db_url)
    assert str(refused.value) == (
        "the database's schema revision 9999_future is newer than this release knows; "
        "upgrade trainguard"
    )
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == "9999_future"
    finally:
        engine.dispose()


def _damaged_sqlite_files(tmp_path: Path) -> dict[str, Path]:
    """A file that is not SQLite at all, and a real database cut in half."""
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    whole = tmp_path / "whole.db"
    upgrade(f"sqlite:///{whole}")
    truncated = tmp_path / "truncated.db"
    data = whole.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    return {"file is not a database": garbage, "database disk image is malformed": truncated}


def test_damaged_sqlite_file_is_refused_in_one_line_and_left_alone(tmp_path: Path) -> None:
    """Neither the controller's start nor ``upgrade`` may overwrite what might be the only
    copy of the operator's data, and SQLAlchemy's message does not name the file."""
    for reason, path in _damaged_sqlite_files(tmp_path).items():
        before = path.read_bytes()
        expected = f"database file {path} is not a SQLite database (or is damaged): {reason}"
        url = f"sqlite:///{path}"
        with pytest.raises(BadConfig) as refused:
            prepare_database(ControllerSettings(database_url=url, tokens=TOKENS))
        assert str(refused.value) == expected
        with pytest.raises(BadConfig) as refused:
            upgrade(url)
        assert str(refused.value) == expected
        assert path.read_bytes() == before


def test_failed_commit_is_503_and_retry_is_accepted(
    live_controller, ctl_report, ctl_metric, ctl_db_outage
) -> None:
    """The database is away for one report (its statements fail with the driver's
    ``OperationalError``): 503 with Retry-After, nothing of it counted or shown, and the
    agent's retry of the same report is accepted once the database is back."""
    agent = live_controller.headers("agent")
    with http_calls.client(base_url=live_controller.url, timeout=15) as client:
        assert client.post("/api/v1/reports", json=ctl_report("node-d", 0), headers=agent)
        ctl_db_outage.arm(r"^\s*INSERT INTO nodes")
        second = ctl_report("node-d", 1)
        r = client.post("/api/v1/reports", json=second, headers=agent)
        assert r.status_code == 503, r.text
        assert r.json()["detail"].startswith("report not stored: database commit failed")
        assert r.headers["retry-after"] == "1"
        ctl_db_outage.disarm()

        retry = client.post("/api/v1/reports", json=second, headers=agent)
        assert retry.status_code == 200 and retry.json()["duplicate"] is False
        again = client.post("/api/v1/reports", json=second, headers=agent)
        assert again.json()["duplicate"] is True
        metrics = client.get("/metrics").text
        detail = client.get("/api/v1/nodes/node-d", headers=live_controller.headers()).json()
    assert ctl_metric(metrics, "trainguard_ingest_reports_total") == 2
    assert ctl_metric(metrics, "trainguard_ingest_failed_reports_total") == 1
    assert ctl_metric(metrics, "trainguard_ingest_gpu_samples_total") == 2 * 40
    assert len(detail["history"]) == 2 * 8


def test_one_bad_report_does_not_fail_its_batch(
    controller_factory, db_url: str, ctl_report
) -> None:
    live = controller_factory(ingest_flush_interval_s=0.3)
    engine = make_engine(db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER tg_test_poison BEFORE INSERT ON gpu_history "
                    "WHEN NEW.node_name = 'node-poison' BEGIN SELECT RAISE(ABORT, 'bad row'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "ALTER TABLE gpu_history ADD CONSTRAINT tg_test_poison "
                    "CHECK (node_name <> 'node-poison') NOT VALID"
                )
            )
    engine.dispose()
    names = [f"node-{i}" for i in range(5)] + ["node-poison"]

    async def send() -> dict[str, int]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/api/v1/reports", json=ctl_report(n, 0), headers=live.headers("agent")
                    )
                    for n in names
                )
            )
        return {n: r.status_code for n, r in zip(names, replies, strict=True)}

    statuses = asyncio.run(send())
    # The database refuses node-poison's rows: a report that can never be stored is the
    # agent's error (409, it sets the report aside), never "retry later" forever.
    assert statuses == {**dict.fromkeys(names[:5], 200), "node-poison": 409}
    poison = http_calls.get(f"{live.url}/api/v1/nodes/node-poison", headers=live.headers())
    assert poison.status_code == 404  # memory holds only what the database does
    for name in names[:5]:
        detail = http_calls.get(f"{live.url}/api/v1/nodes/{name}", headers=live.headers()).json()
        assert len(detail["history"]) == 8


@pytest.mark.slow
def test_ack_survives_kill_9(tmp_path, db_url: str, ctl_report) -> None:
    """Acknowledged reports are on disk: SIGKILL the controller right after the acks."""
    if db_url.startswith("postgresql"):
        upgrade(db_url)
    env = {
        **os.environ,
        "TRAINGUARD_DATABASE_URL": db_url,
        "TRAINGUARD_PORT": "0",
        "TRAINGUARD_TOKENS": json.dumps([{"name": "a", "role": "agent", "token": "a" * 24}]),
        "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",
        "TRAINGUARD_INGEST_FLUSH_INTERVAL_S": "0.05",
    }
    code = (
        "from controller.server import serve; "
        "from controller.settings import ControllerSettings as S; serve(S())"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # ends at EOF if the process dies
            if '"controller listening"' in line:
                url = json.loads(line)["url"]
                break
        assert url is not None
        headers = {"Authorization": "Bearer " + "a" * 24}
        deadline = time.monotonic() + 20
        while True:
            try:
                if http_calls.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.ConnectError:
                pass  # bound, not yet listening
            assert time.monotonic() < deadline, "controller not ready in 20 s"
            time.sleep(0.05)
        for seq in range(10):
            r = http_calls.post(
                f"{url}/api/v1/reports", json=ctl_report("node-k", seq), headers=headers
            )
            assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM gpu_history")).scalar()
            seq = conn.execute(text("SELECT last_seq FROM agent_cursors")).scalar()
    finally:
        engine.dispose()
    assert rows == 10 * 8 and seq == 9
