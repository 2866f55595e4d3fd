"""The checkpoint events' tier (``local`` or ``object_store``), issue 19.

Backward compatible (expand only): one column added to ``checkpoints``, NOT NULL with the
server default ``'local'``, nothing altered or dropped. Existing rows were all written
before the object-store tier reported events other than through their kind, and get
``local``; a controller of the previous release keeps running on this schema during a
rolling upgrade: it never reads the column, and its inserts, which do not name it, get the
default: its object-store upload events still say so in their kind (``upload_*``,
``uploaded``), and a node-local root's ``committed`` (tier ``object_store``) stored as
``local`` still counts as the commit it is (the rollback reads commits of both tiers).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "checkpoints",
        sa.Column("tier", sa.String(length=16), server_default="local", nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:  # SQLite: a copy of the table
        batch.drop_column("tier")
