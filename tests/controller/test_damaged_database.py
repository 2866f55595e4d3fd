"""A database the operator pointed at by mistake is refused in one line, exit 2, untouched.

Another application's database (tables but no ``alembic_version``), ours with its revision
row lost, a directory where the SQLite file should be, and a schema a newer release wrote
(``db upgrade`` only: the controller still runs against it) all reach the operator through
``trainguard db upgrade`` or ``trainguard controller``; before, the first three printed
SQLAlchemy's ``OperationalError`` with the whole ``CREATE TABLE`` statement, exit 1.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from controller.db.session import make_engine
from tests.environ import clean_env

if TYPE_CHECKING:
    from tests.conftest import SchemaTemplates, Tg

pytestmark = pytest.mark.slow  # each test runs the CLI as a process of its own

ADVICE = (
    "but no trainguard schema revision (another application's database, or its "
    "alembic_version row was lost): point --database-url at an empty or trainguard database"
)


def _env() -> dict[str, str]:

    tokens = [{"name": "v", "role": "viewer", "token": secrets.token_urlsafe(24)}]
    env = clean_env()
    return env | {"TRAINGUARD_TOKENS": json.dumps(tokens)}


def _where(db_url: str) -> str:
    """How the message names the database: the SQLite file, or the URL without password."""
    parsed = make_url(db_url)
    if parsed.get_backend_name() == "sqlite":
        return f"database file {parsed.database}"
    return f"database {parsed.render_as_string(hide_password=True)}"


def _tables(db_url: str) -> dict[str, list[tuple[object, ...]]]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            names = sorted(inspect(conn).get_table_names())
            return {
                name: [tuple(row) for row in conn.execute(text(f'SELECT * FROM "{name}"'))]
                for name in names
            }
    finally:
        engine.dispose()


def _run(db_url: str, *sql: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            for statement in sql:
                conn.execute(text(statement))
    finally:
        engine.dispose()


COMMANDS = (["db", "upgrade"], ["controller", "--port", "0"])


def test_another_applications_database_is_refused_and_left_as_it_was(db_url: str, tg: Tg) -> None:
    _run(db_url, "CREATE TABLE nodes (x INTEGER)", "INSERT INTO nodes VALUES (7)")
    before = _tables(db_url)
    expected = f"error: {_where(db_url)} holds tables (nodes) {ADVICE}\n"
    for args in COMMANDS:
        proc = tg(*args, "--database-url", db_url, env=_env())
        assert (proc.returncode, proc.stderr) == (2, expected), args
        assert _tables(db_url) == before, args  # no alembic_version, no table of ours


def test_our_database_with_its_revision_row_lost_is_refused(
    db_url: str, schema_templates: SchemaTemplates, tg: Tg
) -> None:
    assert schema_templates.fill(db_url)  # migrated to head (a copy)
    _run(db_url, "DELETE FROM alembic_version")
    before = _tables(db_url)
    for args in COMMANDS:
        proc = tg(*args, "--database-url", db_url, env=_env())
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(f"error: {_where(db_url)} holds tables (actions, ")
        assert proc.stderr.endswith(f" more) {ADVICE}\n") and proc.stderr.count("\n") == 1
        assert _tables(db_url) == before, args


def test_a_directory_as_the_sqlite_file_is_one_line(tmp_path: Path, tg: Tg) -> None:
    folder = tmp_path / "trainguard.db"
    folder.mkdir()
    expected = (
        f"error: database path {folder} is a directory: name a file (sqlite:///path/to/file.db)\n"
    )
    for args in COMMANDS:
        proc = tg(*args, "--database-url", f"sqlite:///{folder}", env=_env())
        assert (proc.returncode, proc.stderr) == (2, expected), args
    assert list(folder.iterdir()) == []


def test_db_upgrade_of_a_schema_from_a_newer_release_is_the_operators_error(
    db_url: str, schema_templates: SchemaTemplates, tg: Tg
) -> None:
    """The wrong binary for this database: exit 2, and the revision is left as it was (the
    controller deliberately still runs against it: ``schema_at_or_past_head``)."""
    assert schema_templates.fill(db_url)
    _run(db_url, "UPDATE alembic_version SET version_num = '9999_future'")
    proc = tg("db", "upgrade", "--database-url", db_url, env=_env())
    assert (proc.returncode, proc.stderr) == (
        2,
        "error: the database's schema revision 9999_future is newer than this release "
        "knows; upgrade trainguard\n",
    )
    assert _tables(db_url)["alembic_version"] == [("9999_future",)]
