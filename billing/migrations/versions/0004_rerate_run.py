"""rerate_run: applied re-rates (who, when, what changed); usage_event/usage_adjustment.rerate_run_id mark them

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import kvroute.billing.models

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rerate_run',
    sa.Column('rerate_run_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('app_id', sa.String(length=200), nullable=True),
    sa.Column('created_by', sa.String(length=100), nullable=False),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('events_rerated', sa.Integer(), nullable=False),
    sa.Column('adjustments_booked', sa.Integer(), nullable=False),
    sa.Column('summary', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('rerate_run_id', name=op.f('pk_rerate_run'))
    )
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rerate_run_id', sa.Integer(), nullable=True))
    with op.batch_alter_table('usage_adjustment', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rerate_run_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_adjustment', schema=None) as batch_op:
        batch_op.drop_column('rerate_run_id')
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.drop_column('rerate_run_id')
    op.drop_table('rerate_run')
