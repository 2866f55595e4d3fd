"""Programmatic Alembic: the migrations ship inside the package, no ``alembic.ini`` needed.

``trainguard db upgrade`` calls :func:`upgrade`; the controller calls it itself on SQLite
(an embedded database has no separate operator) and only *checks* PostgreSQL, where
migrating is a deliberate step of an upgrade.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, event, inspect, text
from sqlalchemy.exc import DBAPIError

from controller.db.session import make_engine, sqlite_file, sqlite_file_problem
from controller.errors import BadConfig, StartupError
from trainguard.urls import shown_url

MIGRATIONS_DIR = Path(__file__).with_name("migrations")

#: Key of the PostgreSQL advisory lock that serializes migrations (any constant that no
#: other user of the database picks; this is "trainguard" read as ASCII, truncated).
MIGRATION_LOCK_KEY = 0x747261696E677561


class SchemaTooNew(StartupError):
    """The database was migrated by a newer release; this one cannot migrate it (alembic's
    own message, "Can't locate revision identified by ...", does not say so)."""


class NotOurDatabase(BadConfig):
    """The database holds tables but no trainguard schema revision: another application's
    database, or ours with its ``alembic_version`` row lost.

    Why: migrating would run ``CREATE TABLE`` over tables that are not ours (SQLAlchemy's
    "table nodes already exists", with the whole DDL, at best; on a database whose tables
    happen not to collide, our tables mixed into someone else's schema at worst).
    """


#: Alembic's own table: present but empty is no revision (its row was lost).
VERSION_TABLE = "alembic_version"


def refuse_foreign_tables(conn: Connection, database_url: str) -> None:
    """Raise :class:`NotOurDatabase` when the database (the default schema on PostgreSQL)
    holds tables other than alembic's; call it only where no revision was found."""
    tables = sorted(name for name in inspect(conn).get_table_names() if name != VERSION_TABLE)
    if not tables:
        return
    path = sqlite_file(database_url)
    where = f"database file {path}" if path is not None else f"database {shown_url(database_url)}"
    shown = ", ".join(tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")
    raise NotOurDatabase(
        f"{where} holds tables ({shown}) but no trainguard schema revision (another "
        f"application's database, or its {VERSION_TABLE} row was lost): point --database-url "
        "at an empty or trainguard database"
    )


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would choke on '%' in passwords.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def revision_of(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return revision_of(conn)


def _begin_immediate(engine: Engine) -> None:
    """Make this (migration-only) SQLite engine take the write lock when a transaction
    begins, and run DDL inside it.

    pysqlite begins transactions lazily and only for DML, so two migrating processes would
    both read "no version table" and then collide (``table ... already exists`` or an
    immediate ``database is locked``). ``BEGIN IMMEDIATE`` makes the second one wait (busy
    timeout) until the first commits, and then find the head revision.
    """

    @event.listens_for(engine, "connect")
    def _driver_autocommit(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy, not the driver, emits BEGIN

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def upgrade(database_url: str, revision: str = "head") -> str:
    """Bring the schema at ``database_url`` to ``revision``; returns the revision now in place.

    Raises :class:`SchemaTooNew` for a schema a newer release wrote, :class:`NotOurDatabase`
    for a database that holds tables but no revision (checked before any ``CREATE``), and
    :class:`~controller.errors.BadConfig` (one line naming the file, which is left as it
    is) for a SQLite file that is read-only, not a database, damaged or a directory.

    Safe to run from several processes at once (two controller pods' migration init
    containers, or ``trainguard db upgrade`` beside a starting SQLite controller): one
    migrates, the others wait for it and then find nothing to do.
    """
    engine = make_engine(database_url)
    if engine.dialect.name == "sqlite":
        _begin_immediate(engine)
    try:
        config = alembic_config(database_url)
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Two controller pods starting together both run the migration init
                # container; unserialized, the second fails with DuplicateTable and its pod
                # crash-loops. Held until this transaction ends, so the waiter then sees
                # the head revision and does nothing.
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
            found = revision_of(conn)
            if found is None:
                refuse_foreign_tables(conn, database_url)
            elif not known_revision(found):
                raise SchemaTooNew(
                    f"the database's schema revision {found} is newer than this release "
                    "knows; upgrade trainguard"
                )
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
        current = current_revision(engine)
    except DBAPIError as exc:
        problem = sqlite_file_problem(database_url, exc)
        if problem is None:
            raise
        raise BadConfig(problem) from exc
    finally:
        engine.dispose()
    assert current is not None
    return current


def is_up_to_date(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()


def schema_at_or_past_head(current: str | None) -> bool:
    """Whether this release may run against a schema at revision ``current``.

    At head: yes. A revision this release's migrations do not contain was written by a newer
    release, whose expand-only migrations keep this one working (one release back), so yes:
    a rollout's new pod migrates before the old leader hands over. A revision it knows but
    that is not head (or no schema at all) is behind: no. ``/readyz`` and startup share this.
    """
    if current is None:
        return False
    if current == head_revision():
        return True
    return not known_revision(current)


def known_revision(revision: str) -> bool:
    """Whether this release's migrations contain ``revision`` (one it lacks was written by
    a newer release)."""
    from alembic.util.exc import CommandError

    try:
        known = ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision(revision)
    except CommandError:
        return False
    return known is not None
