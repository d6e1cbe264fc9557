"""payout.fee_amount: per-request fees apart from markup, so a frozen payout row adds up

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import kvroute.billing.models

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('payout', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fee_amount', kvroute.billing.models.Money(precision=38, scale=10),
                                      nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('payout', schema=None) as batch_op:
        batch_op.drop_column('fee_amount')
