"""Per-node agent credentials (sha256 digests only), issue 14.

Backward compatible (expand only): one new table, nothing altered or dropped, so a
controller of the previous release keeps running on this schema during a rolling upgrade
(it never reads the table; shared agent tokens keep working there).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_credentials",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("node_name", sa.String(length=253), nullable=False),
        sa.Column("created_unix_s", sa.Double(), nullable=False),
        sa.Column("expires_unix_s", sa.Double(), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_agent_credentials")),
    )
    op.create_index(
        op.f("ix_agent_credentials_node_name"), "agent_credentials", ["node_name"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_agent_credentials_node_name"), table_name="agent_credentials")
    op.drop_table("agent_credentials")
