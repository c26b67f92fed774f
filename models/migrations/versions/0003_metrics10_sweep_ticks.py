"""sweep ticks log; indexes for the metrics' counts and the console's pages

Revision ID: 0003_metrics10
Revises: 0002_perf12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0003_metrics10'
down_revision = '0002_perf12'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('sweep_ticks',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('sweep', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('run', sa.String(length=16), nullable=False),
    sa.Column('took_ms', sa.Integer(), nullable=False),
    sa.Column('counts', sa.JSON(), nullable=False),
    sa.Column('items', sa.JSON(), nullable=False),
    sa.Column('task_id', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sweep_ticks'))
    )
    with op.batch_alter_table('sweep_ticks', schema=None) as batch_op:
        batch_op.create_index('ix_sweep_ticks_sweep_id', ['sweep', 'id'], unique=False)
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index('ix_leases_state_provider_tenant', ['state', 'provider', 'tenant'],
                              unique=False)
        batch_op.create_index('ix_leases_state_lease_id', ['state', 'lease_id'], unique=False)
        batch_op.create_index('ix_leases_tenant_lease_id', ['tenant', 'lease_id'], unique=False)
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index('ix_runs_reclaimed_at', ['reclaimed_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_reclaimed_at')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_tenant_lease_id')
        batch_op.drop_index('ix_leases_state_lease_id')
        batch_op.drop_index('ix_leases_state_provider_tenant')
    with op.batch_alter_table('sweep_ticks', schema=None) as batch_op:
        batch_op.drop_index('ix_sweep_ticks_sweep_id')
    op.drop_table('sweep_ticks')
