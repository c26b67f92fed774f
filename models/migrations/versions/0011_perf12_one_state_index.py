"""one index led by a lease's state instead of two: a state change writes one fewer

Revision ID: 0011_perf12
Revises: 0010_perf12

``ix_leases_state_provider_tenant`` (the metrics' counts by state, provider and tenant)
and ``ix_leases_state_lease_id`` (the keyset pages of a listing filtered by state) both
led with the state, so every state change moved an entry in each: about six pages of the
49 a lease's acquire and destroy write to SQLite's WAL, and one more index entry per
update on PostgreSQL. ``ix_leases_state_lease_id_provider_tenant`` serves both: its
``(state, lease_id)`` prefix walks the pages, and it covers the counts.
"""

from __future__ import annotations

from alembic import op

revision = '0011_perf12'
down_revision = '0010_perf12'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_leases_state_lease_id_provider_tenant', 'leases',
                    ['state', 'lease_id', 'provider', 'tenant'], unique=False)
    op.drop_index('ix_leases_state_provider_tenant', table_name='leases')
    op.drop_index('ix_leases_state_lease_id', table_name='leases')


def downgrade() -> None:
    op.create_index('ix_leases_state_lease_id', 'leases', ['state', 'lease_id'], unique=False)
    op.create_index('ix_leases_state_provider_tenant', 'leases',
                    ['state', 'provider', 'tenant'], unique=False)
    op.drop_index('ix_leases_state_lease_id_provider_tenant', table_name='leases')
