"""backend.cancel_billing (what its provider bills for a cancelled call), price_rule.bill_cancelled and
price_rule.bill_hedge_lost

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('backend', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cancel_billing', sa.String(length=10), nullable=True))
    with op.batch_alter_table('price_rule', schema=None) as batch_op:
        batch_op.add_column(sa.Column('bill_cancelled', sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column('bill_hedge_lost', sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('price_rule', schema=None) as batch_op:
        batch_op.drop_column('bill_hedge_lost')
        batch_op.drop_column('bill_cancelled')
    with op.batch_alter_table('backend', schema=None) as batch_op:
        batch_op.drop_column('cancel_billing')
