"""An index on ``jobs.last_seen_unix_s``, for the retained jobs a new leader reads back.

A new leader loads only the jobs heard from within ``job_retention_s``
(``controller.loader``, job retention): ``WHERE last_seen_unix_s > :since``, and the ranks
joined to those jobs. Without an index that read scanned the whole ``jobs`` table, every
job ever stored, at each election; with it, it reads the recent ones only.

Backward compatible (expand only): one index added, nothing altered or dropped, so a
controller of the previous release keeps running on this schema during a rolling upgrade.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f("ix_jobs_last_seen_unix_s"), "jobs", ["last_seen_unix_s"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_last_seen_unix_s"), table_name="jobs")
