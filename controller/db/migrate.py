"""Programmatic Alembic: the migrations ship inside the package, no ``alembic.ini`` needed.

``trainguard db upgrade`` calls :func:`upgrade`; the controller calls it itself on SQLite
(an embedded database has no separate operator) and only *checks* PostgreSQL, where
migrating is a deliberate step of an upgrade.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from controller.db.session import make_engine

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


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


def upgrade(database_url: str, revision: str = "head") -> str:
    """Bring the schema at ``database_url`` to ``revision``; returns the revision now in place."""
    engine = make_engine(database_url)
    try:
        config = alembic_config(database_url)
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
        current = current_revision(engine)
    finally:
        engine.dispose()
    assert current is not None
    return current


def is_up_to_date(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()
