"""provider errors log: one row per ProviderError a provider call raised

Revision ID: 0004_errors10
Revises: 0003_metrics10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0004_errors10'
down_revision = '0003_metrics10'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('provider_errors',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('provider', sa.String(length=64), nullable=False),
    sa.Column('operation', sa.String(length=32), nullable=False),
    sa.Column('task', sa.String(length=64), nullable=True),
    sa.Column('error_class', sa.String(length=16), nullable=False),
    sa.Column('status', sa.Integer(), nullable=True),
    sa.Column('error_type', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_provider_errors'))
    )


def downgrade() -> None:
    op.drop_table('provider_errors')
