"""The service commands: ``db upgrade``, ``controller`` (flags, config file, refusals)."""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests import http_calls
from tests.cli.cli_testkit import controller_ready, feed
from tests.environ import clean_env
from trainguard.cli.app import run
from trainguard.cli.procs import ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

if TYPE_CHECKING:
    from tests.conftest import SchemaTemplates, Tg


@pytest.mark.slow  # runs the CLI as a process of its own
def test_db_upgrade_reports_the_revision_and_is_idempotent(db_url: str, tg: Tg) -> None:
    first = tg("db", "upgrade", "--database-url", db_url, env=clean_env())
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("database at ") and " is at revision " in first.stdout
    second = tg("db", "upgrade", "--database-url", db_url, env=clean_env())
    assert second.returncode == 0 and second.stdout == first.stdout


def test_printed_database_urls_hide_passwords() -> None:
    from trainguard.urls import shown_url

    assert shown_url("postgresql://tg:s3cret@db:5432/tg") == "postgresql://tg:***@db:5432/tg"
    assert shown_url("postgresql://tg@db/tg") == "postgresql://tg@db/tg"
    assert shown_url("sqlite:////var/lib/tg.db") == "sqlite:////var/lib/tg.db"


@pytest.mark.slow  # runs the CLI as a process of its own
@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_controller_refuses_unmigrated_postgres_in_one_line(db_url: str, tg: Tg) -> None:
    token = secrets.token_urlsafe(24)
    env = clean_env(TRAINGUARD_TOKENS=json.dumps([{"name": "v", "role": "viewer", "token": token}]))
    proc = tg("controller", "--port", str(free_port()), "--database-url", db_url, env=env)
    assert proc.returncode == 1
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "trainguard db upgrade" in error_lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # runs the CLI as a process of its own
def test_controller_without_tokens_outside_dev_is_exit_2(tmp_path: Path, tg: Tg) -> None:
    proc = tg("controller", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/x.db",
               env=clean_env())  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: invalid controller settings: no API tokens configured")
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow  # runs the CLI as a process of its own
def test_controller_on_a_taken_port_is_exit_1(tmp_path: Path, tg: Tg) -> None:
    token = secrets.token_urlsafe(24)
    env = clean_env(TRAINGUARD_TOKENS=json.dumps([{"name": "v", "role": "viewer", "token": token}]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = tg("controller", "--port", str(port), "--database-url",
                   f"sqlite:///{tmp_path}/x.db", env=env)  # fmt: skip
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "in use" in errors[0].lower(), proc.stderr


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_controller_reads_config_file_and_flags_override_it(tmp_path: Path) -> None:
    viewer, agent = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    flag_port, file_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "port": file_port,
                "database_url": f"sqlite:///{tmp_path / 'from-config.db'}",
                "tokens": [
                    {"name": "v", "role": "viewer", "token": viewer},
                    {"name": "a", "role": "agent", "token": agent},
                ],
            }
        )
    )
    argv = cli_argv("controller", "--config", str(config), "--port", str(flag_port))
    url = f"http://127.0.0.1:{flag_port}"
    with ProcessSet(tmp_path / "logs") as procs:
        child = procs.start("controller", argv, env=clean_env())
        assert wait_until(lambda: controller_ready(url) or not child.alive(), timeout_s=60)
        assert child.alive(), child.log_tail()
        assert (tmp_path / "from-config.db").exists()
        reply = http_calls.get(
            f"{url}/api/v1/status", headers={"Authorization": f"Bearer {viewer}"}
        )
        assert reply.status_code == 200
        # uvicorn shuts down gracefully, then re-raises SIGTERM, as a well-behaved daemon does
        assert procs.stop("controller") in (0, -signal.SIGTERM)


def test_cli_against_live_controller_on_each_database(
    live_controller: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The in-process controller fixture, on SQLite and PostgreSQL, seen through the CLI."""
    from tests.cli.cli_testkit import CliServer

    server = CliServer(
        url=live_controller.url,
        viewer_token=live_controller.viewer_token,
        agent_token=live_controller.agent_token,
    )
    feed(server)
    common = ["--server", server.url, "--token", server.viewer_token]
    assert run(["status", "-o", "json", *common]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["database"] == live_controller.settings.database_kind()
    assert status["nodes_total"] == 3
    assert run(["nodes", "-o", "name", *common]) == 0
    assert capsys.readouterr().out.split() == ["node/node-a", "node/node-b", "node/node-c"]


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_module_entry_point_matches_console_script() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("trainguard ")


def _as_unprivileged_user() -> list[str]:
    """A prefix that runs a command as a user for whom mode 0444 really is read-only.

    root may write any file whatever its mode, so a test run as root proves nothing about
    a read-only database unless the controller runs as someone else (``nobody``)."""
    import os
    import shutil

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a file read-only for the test")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
@pytest.mark.parametrize("read_only", ["file", "folder"])
def test_controller_refuses_a_read_only_sqlite_database_in_one_line(
    read_only: str, schema_templates: SchemaTemplates
) -> None:
    """Started on it, it would be "ready" and answer every report 503 forever.

    The database is a copy of the migrated template (what ``trainguard db upgrade`` leaves,
    made once per pytest process), not a ``db upgrade`` of its own: that fresh interpreter
    cost a second of CPU and is what the other tests here check."""
    import os
    import tempfile

    prefix = _as_unprivileged_user()
    # Not tmp_path: its parents are private to root, and the controller runs as nobody.
    with tempfile.TemporaryDirectory(prefix="tg-readonly-") as top:
        os.chmod(top, 0o755)
        folder = Path(top) / "data"
        folder.mkdir()
        database = folder / "trainguard.db"
        url = f"sqlite:///{database}"
        assert schema_templates.fill(url)
        if read_only == "file":
            folder.chmod(0o777)
            database.chmod(0o444)
        else:
            database.chmod(0o666)
            folder.chmod(0o555)
        before = database.read_bytes()
        token = secrets.token_urlsafe(24)
        tokens = json.dumps([{"name": "v", "role": "viewer", "token": token}])
        env = clean_env(HOME=top, TRAINGUARD_TOKENS=tokens)
        argv = [*prefix, *cli_argv("controller", "--port", "0", "--database-url", url)]
        # A start is its "controller listening" line, not a slow exit: a fresh interpreter
        # took 24 s to refuse on a loaded 2-core machine, near the 30 s this waited once.
        errors = Path(top) / "stderr"
        with errors.open("w") as sink:
            child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink, env=env)
        deadline = time.monotonic() + 180
        while child.poll() is None:
            if "controller listening" in errors.read_text() or time.monotonic() > deadline:
                child.kill()
                child.wait()
                pytest.fail(f"the controller started on a read-only database ({read_only})")
            time.sleep(0.1)
        stderr = errors.read_text()
        assert child.returncode == 2, stderr
        assert stderr.startswith(f"error: database file {database} is read-only"), stderr
        assert stderr.count("\n") == 1 and "sqlalche.me" not in stderr
        assert database.read_bytes() == before
        folder.chmod(0o755)


@pytest.mark.slow  # runs the CLI as a process of its own
def test_a_file_that_is_not_sqlite_is_exit_2_in_one_line_and_left_alone(
    tmp_path: Path, tg: Tg
) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    url = f"sqlite:///{garbage}"
    token = secrets.token_urlsafe(24)
    tokens = json.dumps([{"name": "v", "role": "viewer", "token": token}])
    env = clean_env(TRAINGUARD_TOKENS=tokens)
    expected = (
        f"error: database file {garbage} is not a SQLite database (or is damaged): "
        "file is not a database\n"
    )
    for args in (["db", "upgrade"], ["controller", "--port", "0"]):
        proc = tg(*args, "--database-url", url, env=env)
        assert (proc.returncode, proc.stderr) == (2, expected), args
    assert garbage.read_bytes() == b"this is not sqlite" * 100


@pytest.mark.slow  # runs the CLI as a process of its own
def test_db_upgrade_on_a_schema_from_a_newer_release_says_so_in_one_line(
    db_url: str, schema_templates: SchemaTemplates, tg: Tg
) -> None:
    from sqlalchemy import text

    from controller.db.session import make_engine

    assert schema_templates.fill(db_url)  # migrated to this release's head (a copy)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    finally:
        engine.dispose()
    proc = tg("db", "upgrade", "--database-url", db_url, env=clean_env())
    assert proc.returncode == 2  # the operator's input: this binary is too old for it
    assert proc.stderr == (
        "error: the database's schema revision 9999_future is newer than this release "
        "knows; upgrade trainguard\n"
    )
