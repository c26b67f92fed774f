"""no index on a lease's sandbox key: nothing looks a lease up by it

Revision ID: 0012_perf12
Revises: 0011_perf12

Leases are found by key through ``live_key`` (``uq_leases_live_key``: live leases only),
and ``ix_leases_sandbox_key`` served one store method that only tests called. Its entry
was written with every lease (a random page: keys hold run ids), and on PostgreSQL again
with every state change (an UPDATE that changes an indexed column writes every index).
"""

from __future__ import annotations

from alembic import op

revision = '0012_perf12'
down_revision = '0011_perf12'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_leases_sandbox_key', table_name='leases')


def downgrade() -> None:
    op.create_index('ix_leases_sandbox_key', 'leases', ['sandbox_key'], unique=False)
