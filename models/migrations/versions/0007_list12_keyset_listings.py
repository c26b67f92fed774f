"""listings as keyset pages: leases by id, runs by start

Revision ID: 0007_list12
Revises: 0006_perf12

`leases list` and the console list leases in one order, newest id first (lease ids begin
with their creation time), so the two indexes of the old created_at order go: every state
change wrote an entry into each. `runs list` pages by (started_at, run_id), which had no
index (each page sorted the whole run history).
"""

from __future__ import annotations

from alembic import op

revision = '0007_list12'
down_revision = '0006_perf12'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_leases_created', table_name='leases')
    op.drop_index('ix_leases_state_created', table_name='leases')
    op.create_index('ix_runs_started', 'runs', ['started_at', 'run_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_runs_started', table_name='runs')
    op.create_index('ix_leases_state_created', 'leases', ['state', 'created_at', 'lease_id'],
                    unique=False)
    op.create_index('ix_leases_created', 'leases', ['created_at', 'lease_id'], unique=False)
