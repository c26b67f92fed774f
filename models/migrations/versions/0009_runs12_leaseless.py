"""runs whose acquire never recorded a lease: a partial index for sweep.reap_runs

Revision ID: 0009_runs12
Revises: 0008_perf12

A run is inserted by its acquire; the common acquire binds its lease in the same
transaction, the others a moment later. One still running with no lease long after its
acquire could have been alive was given up on (or its message was lost): the sweep fails
it. The index holds only such runs, so finding them costs nothing at any history size.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009_runs12'
down_revision = '0008_perf12'
branch_labels = None
depends_on = None

PREDICATE = "status = 'running' AND lease_id IS NULL"


def upgrade() -> None:
    op.create_index('ix_runs_leaseless', 'runs', ['started_at'], unique=False,
                    postgresql_where=sa.text(PREDICATE), sqlite_where=sa.text(PREDICATE))


def downgrade() -> None:
    op.drop_index('ix_runs_leaseless', table_name='runs')
