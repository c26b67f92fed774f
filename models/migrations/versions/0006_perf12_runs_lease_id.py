"""runs by lease: the index every lease end uses to settle its runs

Revision ID: 0006_perf12
Revises: 0005_pools13

A lease that ends aborts the runs still running on it, and a destroy that takes (or is
undone) corrects their reclaim outcome: both find the runs by ``lease_id``, inside the
state change's transaction, on every destroy. Without this index each was a scan of the
whole run history.
"""

from __future__ import annotations

from alembic import op

revision = '0006_perf12'
down_revision = '0005_pools13'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_runs_lease_id', 'runs', ['lease_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_runs_lease_id', table_name='runs')
