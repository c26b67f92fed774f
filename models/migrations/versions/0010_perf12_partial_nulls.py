"""indexes without the NULLs no query looks for: fewer entries written per run and lease

Revision ID: 0010_perf12
Revises: 0009_runs12

A run's thread_id is NULL unless it belongs to a thread, its reclaimed_at NULL until it is
reclaimed, and a lease's live_key NULL once the lease is no longer live: most of the
history. Their indexes held an entry for every NULL, written when the run starts (two
entries) and when the lease leaves the live states (one, besides deleting its key), yet
every query through them asks for a value (``thread_id = ?``, ``reclaimed_at >= ?``,
``live_key = ?``). Each becomes a partial index of the rows that have one; live keys stay
unique among live leases. On SQLite the unique constraint is dropped by rebuilding the
table (the batch copy keeps every other index, partial predicates included).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0010_perf12'
down_revision = '0009_runs12'
branch_labels = None
depends_on = None


def _not_null(column: str) -> dict[str, Any]:
    predicate = sa.text(f"{column} IS NOT NULL")
    return {"postgresql_where": predicate, "sqlite_where": predicate}


def upgrade() -> None:
    for index, column in (("ix_runs_thread_id", "thread_id"),
                          ("ix_runs_reclaimed_at", "reclaimed_at")):
        op.drop_index(index, table_name='runs')
        op.create_index(index, 'runs', [column], unique=False, **_not_null(column))
    with op.batch_alter_table('leases') as batch:
        batch.drop_constraint('uq_leases_live_key', type_='unique')
    op.create_index('uq_leases_live_key', 'leases', ['live_key'], unique=True,
                    **_not_null('live_key'))


def downgrade() -> None:
    op.drop_index('uq_leases_live_key', table_name='leases')
    with op.batch_alter_table('leases') as batch:
        batch.create_unique_constraint('uq_leases_live_key', ['live_key'])
    for index, column in (("ix_runs_reclaimed_at", "reclaimed_at"),
                          ("ix_runs_thread_id", "thread_id")):
        op.drop_index(index, table_name='runs')
        op.create_index(index, 'runs', [column], unique=False)
