"""Traffic plans (every version) and fabric link states.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "traffic_plans",
        sa.Column("plan_id", sa.String(length=32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("job_name", sa.String(length=253), nullable=False),
        sa.Column("created_unix_s", sa.Double(), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("plan_id", "version", name=op.f("pk_traffic_plans")),
    )
    op.create_index(
        op.f("ix_traffic_plans_job_name"), "traffic_plans", ["job_name"], unique=False
    )
    op.create_table(
        "traffic_links",
        sa.Column("link", sa.String(length=512), nullable=False),
        sa.Column("capacity_factor", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("updated_unix_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("link", name=op.f("pk_traffic_links")),
    )


def downgrade() -> None:
    op.drop_table("traffic_links")
    op.drop_index(op.f("ix_traffic_plans_job_name"), table_name="traffic_plans")
    op.drop_table("traffic_plans")
