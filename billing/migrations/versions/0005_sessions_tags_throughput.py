"""usage_event.session_id, usage_event_tag (one row per tag of an event), cost_rate.prefill_tok_s

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import kvroute.billing.models

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.add_column(sa.Column('session_id', sa.String(length=200), nullable=True))
    op.create_table('usage_event_tag',
    sa.Column('event_id', sa.String(length=32), nullable=False),
    sa.Column('tag', sa.String(length=100), nullable=False),
    sa.PrimaryKeyConstraint('event_id', 'tag', name=op.f('pk_usage_event_tag'))
    )
    with op.batch_alter_table('cost_rate', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prefill_tok_s', kvroute.billing.models.Money(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('cost_rate', schema=None) as batch_op:
        batch_op.drop_column('prefill_tok_s')
    op.drop_table('usage_event_tag')
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.drop_column('session_id')
