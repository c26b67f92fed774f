"""sweep and listing indexes: every sweep read is an ordered index range scan

Partial indexes for each sweep's due rows (only the few rows in that state or with a
pending reclaim), (created_at, lease_id) and (state, created_at, lease_id) for paginated
listings; drops ix_leases_state and ix_runs_status (the leading column of a composite
index already serves them) and ix_leases_state_next_cleanup (its only reader, the cleanup
sweep, now reads ix_leases_pending_cleanup_created).

Revision ID: 0002_perf12
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002_perf12"
down_revision = "0001"
branch_labels = None
depends_on = None

UNRECLAIMED = "reclaim_due IS TRUE AND reclaim_outcome IS NULL"
LEASE_PARTIAL = {
    "ix_leases_active_deadline": (["deadline_at"], "active"),
    "ix_leases_active_idle_deadline": (["idle_deadline_at"], "active"),
    "ix_leases_provisioning_deadline": (["acquire_deadline_at", "lease_id"], "provisioning"),
    "ix_leases_destroying_updated": (["updated_at"], "destroying"),
    "ix_leases_pending_cleanup_created": (["created_at", "lease_id"], "pending_cleanup"),
}


def _where(predicate: str) -> dict[str, object]:
    from sqlalchemy import text

    return {"postgresql_where": text(predicate), "sqlite_where": text(predicate)}


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_state")
        batch_op.drop_index("ix_leases_state_next_cleanup")
        batch_op.create_index("ix_leases_created", ["created_at", "lease_id"])
        batch_op.create_index("ix_leases_state_created", ["state", "created_at", "lease_id"])
        for name, (columns, state) in LEASE_PARTIAL.items():
            batch_op.create_index(name, columns, **_where(f"state = '{state}'"))
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status")
        batch_op.create_index("ix_runs_reclaim_pending", ["finished_at"], **_where(UNRECLAIMED))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_reclaim_pending")
        batch_op.create_index("ix_runs_status", ["status"])
    with op.batch_alter_table("leases", schema=None) as batch_op:
        for name in reversed(LEASE_PARTIAL):
            batch_op.drop_index(name)
        batch_op.drop_index("ix_leases_state_created")
        batch_op.drop_index("ix_leases_created")
        batch_op.create_index("ix_leases_state_next_cleanup", ["state", "next_cleanup_at"])
        batch_op.create_index("ix_leases_state", ["state"])
