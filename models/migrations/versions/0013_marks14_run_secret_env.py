"""runs.secret_env_given: whether a run's acquire carried ``secret_env``

Revision ID: 0013_marks14
Revises: 0012_perf12

A run's error (and its lease's destroy reason) is scrubbed of its secrets by their marks in
the broker's Redis (tasks/secret_marks.py); marks that Redis lost withhold the text, for a
run known to have had secrets. The lease's spec says so only for the run that made the
sandbox: a reused lease's later runs bring secret_env of their own. The run row says it
for every run. Existing rows are false (their marks still decide as before); the server
default keeps a worker of the revision before, during a rolling upgrade, able to insert.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_marks14"
down_revision = "0012_perf12"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("secret_env_given", sa.Boolean(), nullable=False,
                                      server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("secret_env_given")
