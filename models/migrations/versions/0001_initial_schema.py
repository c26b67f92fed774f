"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-12-02 10:28:57.524500
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('leases',
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('sandbox_key', sa.String(length=128), nullable=False),
    sa.Column('live_key', sa.String(length=128), nullable=True),
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('provider_lease_id', sa.String(length=253), nullable=False),
    sa.Column('backend', sa.String(length=64), nullable=True),
    sa.Column('provider_meta', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=32), nullable=False),
    sa.Column('reuse', sa.Boolean(), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('thread_id', sa.String(length=128), nullable=True),
    sa.Column('run_id', sa.String(length=128), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.Column('ready_at', sa.DateTime(), nullable=True),
    sa.Column('acquire_deadline_at', sa.DateTime(), nullable=False),
    sa.Column('deadline_at', sa.DateTime(), nullable=False),
    sa.Column('idle_timeout_s', sa.Integer(), nullable=False),
    sa.Column('idle_deadline_at', sa.DateTime(), nullable=True),
    sa.Column('cleanup_attempts', sa.Integer(), nullable=False),
    sa.Column('next_cleanup_at', sa.DateTime(), nullable=True),
    sa.Column('end_reason', sa.String(length=64), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('lease_id', name=op.f('pk_leases')),
    sa.UniqueConstraint('live_key', name=op.f('uq_leases_live_key'))
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_leases_provider_lease_id'), ['provider_lease_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_sandbox_key'), ['sandbox_key'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_state'), ['state'], unique=False)
        batch_op.create_index('ix_leases_state_next_cleanup', ['state', 'next_cleanup_at'], unique=False)

    op.create_table('runs',
    sa.Column('run_id', sa.String(length=128), nullable=False),
    sa.Column('thread_id', sa.String(length=128), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('sandbox_key', sa.String(length=128), nullable=True),
    sa.Column('lease_id', sa.String(length=64), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('detached_since', sa.DateTime(), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('reclaim_due', sa.Boolean(), nullable=False),
    sa.Column('reclaim_claimed_until', sa.DateTime(), nullable=True),
    sa.Column('reclaim_outcome', sa.String(length=32), nullable=True),
    sa.Column('reclaimed_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_runs'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)
        batch_op.create_index('ix_runs_status_detached', ['status', 'detached_since'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_thread_id'), ['thread_id'], unique=False)

    op.create_table('lease_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('from_state', sa.String(length=32), nullable=True),
    sa.Column('to_state', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('task_id', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['lease_id'], ['leases.lease_id'], name=op.f('fk_lease_events_lease_id_leases')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_lease_events'))
    )
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_lease_events_lease_id'), ['lease_id'], unique=False)



def downgrade() -> None:
    from models.downgrade_guard import refuse_stranding

    refuse_stranding(op.get_bind(), revision)  # live leases it would strand: refused
    with op.batch_alter_table('lease_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_lease_events_lease_id'))

    op.drop_table('lease_events')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_thread_id'))
        batch_op.drop_index('ix_runs_status_detached')
        batch_op.drop_index(batch_op.f('ix_runs_status'))

    op.drop_table('runs')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_state_next_cleanup')
        batch_op.drop_index(batch_op.f('ix_leases_state'))
        batch_op.drop_index(batch_op.f('ix_leases_sandbox_key'))
        batch_op.drop_index(batch_op.f('ix_leases_provider_lease_id'))

    op.drop_table('leases')
