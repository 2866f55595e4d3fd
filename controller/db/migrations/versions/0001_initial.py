"""Initial schema: inventory, jobs, history, incidents, actions, commands, power domains.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('actions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('target', sa.String(length=512), nullable=False),
    sa.Column('trigger', sa.String(length=128), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('outcome', sa.Text(), nullable=False),
    sa.Column('created_unix_s', sa.Double(), nullable=False),
    sa.Column('finished_unix_s', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_actions'))
    )
    op.create_index(op.f('ix_actions_created_unix_s'), 'actions', ['created_unix_s'], unique=False)

    op.create_table('incidents',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('node_name', sa.String(length=253), nullable=True),
    sa.Column('gpu_index', sa.Integer(), nullable=True),
    sa.Column('job_name', sa.String(length=253), nullable=True),
    sa.Column('ranks', sa.JSON(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('dedupe_key', sa.String(length=512), nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('opened_unix_s', sa.Double(), nullable=False),
    sa.Column('updated_unix_s', sa.Double(), nullable=False),
    sa.Column('resolved_unix_s', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_incidents'))
    )
    op.create_index(op.f('ix_incidents_opened_unix_s'), 'incidents', ['opened_unix_s'], unique=False)
    op.create_index(op.f('ix_incidents_state_kind'), 'incidents', ['state', 'kind'], unique=False)

    op.create_table('jobs',
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('last_step', sa.BigInteger(), nullable=True),
    sa.Column('first_seen_unix_s', sa.Double(), nullable=False),
    sa.Column('last_seen_unix_s', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_jobs'))
    )
    op.create_table('nodes',
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('hostname', sa.String(length=253), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('agent_version', sa.String(length=64), nullable=False),
    sa.Column('driver_version', sa.String(length=64), nullable=False),
    sa.Column('health', sa.String(length=16), nullable=False),
    sa.Column('health_reason', sa.Text(), nullable=False),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('power_w', sa.Double(), nullable=True),
    sa.Column('spool_dropped_total', sa.BigInteger(), nullable=False),
    sa.Column('first_seen_unix_s', sa.Double(), nullable=False),
    sa.Column('last_report_unix_s', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_nodes'))
    )
    op.create_table('power_domains',
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('parent', sa.String(length=253), nullable=True),
    sa.Column('provisioned_power_w', sa.Double(), nullable=True),
    sa.Column('node_name', sa.String(length=253), nullable=True),
    sa.Column('gpu_index', sa.Integer(), nullable=True),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['parent'], ['power_domains.name'], name=op.f('fk_power_domains_parent_power_domains'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_power_domains'))
    )
    op.create_table('agent_cursors',
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('agent_instance', sa.String(length=64), nullable=False),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.Column('updated_unix_s', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['node_name'], ['nodes.name'], name=op.f('fk_agent_cursors_node_name_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('node_name', 'agent_instance', name=op.f('pk_agent_cursors'))
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_name', sa.String(length=253), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('blocking_s', sa.Double(), nullable=True),
    sa.Column('duration_s', sa.Double(), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('time_unix_s', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['job_name'], ['jobs.name'], name=op.f('fk_checkpoints_job_name_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints'))
    )
    op.create_index(op.f('ix_checkpoints_job_name_step'), 'checkpoints', ['job_name', 'step'], unique=False)

    op.create_table('commands',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_unix_s', sa.Double(), nullable=False),
    sa.Column('sent_unix_s', sa.Double(), nullable=True),
    sa.Column('finished_unix_s', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['node_name'], ['nodes.name'], name=op.f('fk_commands_node_name_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_commands'))
    )
    op.create_index(op.f('ix_commands_node_name_status'), 'commands', ['node_name', 'status'], unique=False)

    op.create_table('gpu_history',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('gpu_index', sa.Integer(), nullable=False),
    sa.Column('start_unix_s', sa.Double(), nullable=False),
    sa.Column('end_unix_s', sa.Double(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('power_w_avg', sa.Double(), nullable=True),
    sa.Column('power_w_max', sa.Double(), nullable=True),
    sa.Column('temperature_c_max', sa.Double(), nullable=True),
    sa.Column('sm_clock_mhz_avg', sa.Double(), nullable=True),
    sa.Column('utilization_gpu_pct_avg', sa.Double(), nullable=True),
    sa.Column('memory_used_bytes_max', sa.BigInteger(), nullable=True),
    sa.Column('ecc_corrected_total', sa.BigInteger(), nullable=True),
    sa.Column('ecc_uncorrected_total', sa.BigInteger(), nullable=True),
    sa.Column('throttle_reasons_mask', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['node_name'], ['nodes.name'], name=op.f('fk_gpu_history_node_name_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gpu_history'))
    )
    op.create_index(op.f('ix_gpu_history_end_unix_s'), 'gpu_history', ['end_unix_s'], unique=False)
    op.create_index(op.f('ix_gpu_history_node_name_end_unix_s'), 'gpu_history', ['node_name', 'end_unix_s'], unique=False)

    op.create_table('gpus',
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('uuid', sa.String(length=128), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('pci_bus_id', sa.String(length=64), nullable=False),
    sa.Column('memory_total_bytes', sa.BigInteger(), nullable=False),
    sa.Column('health', sa.String(length=16), nullable=False),
    sa.Column('health_reason', sa.Text(), nullable=False),
    sa.Column('ecc_uncorrected_total', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['node_name'], ['nodes.name'], name=op.f('fk_gpus_node_name_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('node_name', 'index', name=op.f('pk_gpus'))
    )
    op.create_table('ranks',
    sa.Column('job_name', sa.String(length=253), nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('node_name', sa.String(length=253), nullable=False),
    sa.Column('gpu_index', sa.Integer(), nullable=True),
    sa.Column('local_rank', sa.Integer(), nullable=True),
    sa.Column('pid', sa.BigInteger(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('last_step', sa.BigInteger(), nullable=True),
    sa.Column('last_seen_unix_s', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['job_name'], ['jobs.name'], name=op.f('fk_ranks_job_name_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_name', 'rank', name=op.f('pk_ranks'))
    )


def downgrade() -> None:
    op.drop_table('ranks')
    op.drop_table('gpus')
    op.drop_index(op.f('ix_gpu_history_node_name_end_unix_s'), table_name='gpu_history')
    op.drop_index(op.f('ix_gpu_history_end_unix_s'), table_name='gpu_history')

    op.drop_table('gpu_history')
    op.drop_index(op.f('ix_commands_node_name_status'), table_name='commands')

    op.drop_table('commands')
    op.drop_index(op.f('ix_checkpoints_job_name_step'), table_name='checkpoints')

    op.drop_table('checkpoints')
    op.drop_table('agent_cursors')
    op.drop_table('power_domains')
    op.drop_table('nodes')
    op.drop_table('jobs')
    op.drop_index(op.f('ix_incidents_state_kind'), table_name='incidents')
    op.drop_index(op.f('ix_incidents_opened_unix_s'), table_name='incidents')

    op.drop_table('incidents')
    op.drop_index(op.f('ix_actions_created_unix_s'), table_name='actions')

    op.drop_table('actions')
