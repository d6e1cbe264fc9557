"""backend.declared_at: set when a price file declares the backend, whose provider and route kind then win

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import kvroute.billing.models

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('backend', schema=None) as batch_op:
        batch_op.add_column(sa.Column('declared_at', kvroute.billing.models.Tz(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('backend', schema=None) as batch_op:
        batch_op.drop_column('declared_at')
