"""Node isolation (why and since when remediation keeps work off a node); actions by trigger.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("isolated_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("isolated_unix_s", sa.Double(), nullable=True))
    op.create_index(op.f("ix_actions_trigger"), "actions", ["trigger"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_actions_trigger"), table_name="actions")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("isolated_unix_s")
        batch.drop_column("isolated_reason")
