"""One repository per aggregate, each the only module that writes its tables.

==================  ==============================================
table               written by
==================  ==============================================
nodes, gpus,        :mod:`.nodes` (isolation: ``set_isolation``)
agent_cursors
jobs, ranks         :mod:`.jobs`
commands            :mod:`.commands`
incidents           :mod:`.incidents`
actions             :mod:`.actions`
gpu_history         :mod:`.history`
checkpoints         :mod:`.checkpoints`
power_domains       :mod:`.power`
traffic_plans,      :mod:`.traffic`
traffic_links
==================  ==============================================

Services never build SQL that writes: they call these functions inside a transaction
(``Store.write`` or the group-commit writer). ``tests/controller/test_ctl_persistence.py``
checks the table above against the code, so a second write path fails the build.

:func:`write_batch` is how the group-commit writer (and an incident's transaction) writes
rows of the state-mirrored tables: whole rows keyed by primary key, plus appended history,
parents before children.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, Table

from controller.db.models import Base, Checkpoint, GpuHistory
from controller.db.repositories import (
    actions,
    checkpoints,
    commands,
    history,
    incidents,
    jobs,
    nodes,
    power,
    traffic,
)

Rows = list[dict[str, Any]]
Writer = Callable[[Connection, Rows], None]

#: Tables in foreign-key order, so parents are written before children in one transaction.
TABLE_ORDER: list[Table] = list(Base.metadata.sorted_tables)

#: How a whole row of each state-mirrored table is stored.
UPSERT: dict[str, Writer] = {
    "nodes": nodes.upsert_nodes,
    "gpus": nodes.upsert_gpus,
    "agent_cursors": nodes.upsert_cursors,
    "jobs": jobs.upsert_jobs,
    "ranks": jobs.upsert_ranks,
    "commands": commands.upsert_commands,
}

#: How rows of each append-only table are stored.
APPEND: dict[str, Writer] = {
    GpuHistory.__tablename__: history.append_history,
    Checkpoint.__tablename__: checkpoints.append_checkpoints,
}


def write_batch(
    conn: Connection, upserts: Mapping[Table, Rows], appends: Mapping[Table, Rows] | None = None
) -> None:
    """Upsert then append, each in foreign-key order, in the caller's transaction."""
    for table in TABLE_ORDER:
        rows = upserts.get(table)
        if rows:
            UPSERT[table.name](conn, rows)
    for table in TABLE_ORDER:
        rows = (appends or {}).get(table)
        if rows:
            APPEND[table.name](conn, rows)


__all__ = [
    "APPEND",
    "TABLE_ORDER",
    "UPSERT",
    "actions",
    "checkpoints",
    "commands",
    "history",
    "incidents",
    "jobs",
    "nodes",
    "power",
    "traffic",
    "write_batch",
]
