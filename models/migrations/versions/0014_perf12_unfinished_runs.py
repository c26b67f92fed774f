"""an index of the runs not finished, by start: the reap of runs on ended leases reads them

Revision ID: 0014_perf12
Revises: 0013_marks14

sweep.reap_runs settles the runs still running or interrupted whose lease has ended
(models/sweep_store.py ``due_runs_on_ended_leases``), oldest first. With no index holding
only those runs it walked ``ix_runs_started`` (every run, by start) and threw away the
finished ones: all the history, on every tick, to find nothing (at 200,000 runs 95 ms on
PostgreSQL). ``ix_runs_unfinished_started`` holds only the runs not finished (its
predicate is the query's, literally, so SQLite's planner uses it too): a tick reads the
live runs and no more.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014_perf12'
down_revision = '0013_marks14'
branch_labels = None
depends_on = None

UNFINISHED = "status IN ('running', 'interrupted')"


def upgrade() -> None:
    predicate = sa.text(UNFINISHED)
    op.create_index('ix_runs_unfinished_started', 'runs', ['started_at'], unique=False,
                    postgresql_where=predicate, sqlite_where=predicate)


def downgrade() -> None:
    op.drop_index('ix_runs_unfinished_started', table_name='runs')
