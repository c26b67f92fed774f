"""warm pools: leases.pool and leases.claimed_at, the pools table (circuit breaker, the
fillers' lock row), the claim's and the member count's partial indexes

The new lease state ``warm`` needs no DDL (states are strings).

Revision ID: 0005_pools13
Revises: 0004_errors10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_pools13"
down_revision = "0004_errors10"
branch_labels = None
depends_on = None


def _where(predicate: str) -> dict[str, object]:
    return {"postgresql_where": sa.text(predicate), "sqlite_where": sa.text(predicate)}


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("consecutive_failures", sa.Integer(), nullable=False),
        sa.Column("failures_total", sa.Integer(), nullable=False),
        sa.Column("open_until", sa.DateTime(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_pools")),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pool", sa.String(length=63), nullable=True))
        batch_op.add_column(sa.Column("claimed_at", sa.DateTime(), nullable=True))
        batch_op.create_index("ix_leases_warm_pool_created", ["pool", "created_at", "lease_id"],
                              **_where("state = 'warm'"))
        batch_op.create_index("ix_leases_pool_members", ["pool", "state"],
                              **_where("pool IS NOT NULL AND run_id IS NULL"))


def downgrade() -> None:
    from models.downgrade_guard import refuse_stranding

    refuse_stranding(op.get_bind(), revision)  # live leases it would strand: refused
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_pool_members")
        batch_op.drop_index("ix_leases_warm_pool_created")
        batch_op.drop_column("claimed_at")
        batch_op.drop_column("pool")
    op.drop_table("pools")
