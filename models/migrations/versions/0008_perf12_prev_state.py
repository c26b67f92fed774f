"""state changes without a locked read: leases.prev_state; lease_events without a foreign key

Revision ID: 0008_perf12
Revises: 0007_list12

A state change sets ``prev_state`` from the row it replaces in its own UPDATE, so its
event names the state really left without the ``SELECT ... FOR UPDATE`` (a row lock, a
WAL record and an index lookup on PostgreSQL; a read first on SQLite) that every change
took before. The events' foreign key checked, on every event, what the statement writing
it already guarantees (it is written from the lease row it changed).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008_perf12'
down_revision = '0007_list12'
branch_labels = None
depends_on = None

FK = 'fk_lease_events_lease_id_leases'


def upgrade() -> None:
    with op.batch_alter_table('leases') as batch:
        batch.add_column(sa.Column('prev_state', sa.String(length=32), nullable=True))
    with op.batch_alter_table('lease_events') as batch:
        batch.drop_constraint(FK, type_='foreignkey')


def downgrade() -> None:
    with op.batch_alter_table('lease_events') as batch:
        batch.create_foreign_key(FK, 'leases', ['lease_id'], ['lease_id'])
    with op.batch_alter_table('leases') as batch:
        batch.drop_column('prev_state')
