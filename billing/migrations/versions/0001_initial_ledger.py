"""initial ledger

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import kvroute.billing.models

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('backend',
    sa.Column('backend_id', sa.String(length=200), nullable=False),
    sa.Column('provider', sa.String(length=100), nullable=False),
    sa.Column('served_model', sa.String(length=200), nullable=True),
    sa.Column('endpoint', sa.String(length=500), nullable=True),
    sa.Column('route_kind', sa.String(length=20), nullable=False),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('backend_id', name=op.f('pk_backend'))
    )
    op.create_table('billing_period',
    sa.Column('app_id', sa.String(length=200), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('status', sa.String(length=10), nullable=False),
    sa.Column('grace_until', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.Column('closed_at', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.Column('totals_hash', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('app_id', 'period', name=op.f('pk_billing_period'))
    )
    op.create_table('payout',
    sa.Column('payout_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('builder_id', sa.String(length=200), nullable=False),
    sa.Column('app_id', sa.String(length=200), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('gross_billed', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('provider_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('absorbed_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('platform_fee', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('payment_fee', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('markup_earned', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('payout_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('status', sa.String(length=10), nullable=False),
    sa.Column('external_ref', sa.String(length=200), nullable=True),
    sa.Column('paid_at', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('payout_id', name=op.f('pk_payout')),
    sa.UniqueConstraint('app_id', 'period', 'currency', name=op.f('uq_payout_app_id'))
    )
    op.create_table('price_book',
    sa.Column('price_book_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('app_id', sa.String(length=200), nullable=True),
    sa.Column('app_key', sa.String(length=200), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('effective_from', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('effective_to', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('platform_fee_pct', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('payment_fee_pct', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('price_book_id', name=op.f('pk_price_book')),
    sa.UniqueConstraint('app_key', 'version', name=op.f('uq_price_book_app_key'))
    )
    op.create_table('statement',
    sa.Column('statement_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('app_id', sa.String(length=200), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('price_book_version_set', sa.JSON(), nullable=True),
    sa.Column('subtotal_billed', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('adjustments_total', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('total_billed', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('total_unrounded', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('provider_cost_total', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('absorbed_cost_total', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('platform_fee', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('payment_fee', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('margin_total', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('finalized_at', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('statement_id', name=op.f('pk_statement')),
    sa.UniqueConstraint('app_id', 'period', 'currency', name=op.f('uq_statement_app_id'))
    )
    op.create_table('usage_adjustment',
    sa.Column('adjustment_id', sa.String(length=32), nullable=False),
    sa.Column('event_id', sa.String(length=32), nullable=True),
    sa.Column('app_id', sa.String(length=200), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('original_period', sa.String(length=7), nullable=True),
    sa.Column('kind', sa.String(length=30), nullable=False),
    sa.Column('delta_provider_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('delta_absorbed_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('delta_billed_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('delta_markup_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('delta_tokens', sa.JSON(), nullable=True),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_by', sa.String(length=100), nullable=True),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('adjustment_id', name=op.f('pk_usage_adjustment'))
    )
    with op.batch_alter_table('usage_adjustment', schema=None) as batch_op:
        batch_op.create_index('ix_usage_adjustment_period', ['period', 'app_id'], unique=False)

    op.create_table('usage_event',
    sa.Column('event_id', sa.String(length=32), nullable=False),
    sa.Column('request_id', sa.String(length=200), nullable=False),
    sa.Column('attempt_no', sa.Integer(), nullable=False),
    sa.Column('is_final_attempt', sa.Boolean(), nullable=False),
    sa.Column('app_id', sa.String(length=200), nullable=False),
    sa.Column('end_user_id', sa.String(length=200), nullable=True),
    sa.Column('api_key_hash', sa.String(length=128), nullable=True),
    sa.Column('occurred_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('received_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('booked_period', sa.String(length=7), nullable=False),
    sa.Column('requested_model', sa.String(length=200), nullable=True),
    sa.Column('served_model', sa.String(length=200), nullable=False),
    sa.Column('provider', sa.String(length=100), nullable=False),
    sa.Column('backend_id', sa.String(length=200), nullable=False),
    sa.Column('route_kind', sa.String(length=20), nullable=False),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('http_status', sa.Integer(), nullable=True),
    sa.Column('error_type', sa.String(length=100), nullable=True),
    sa.Column('streamed', sa.Boolean(), nullable=False),
    sa.Column('sticky_hit', sa.Boolean(), nullable=False),
    sa.Column('fallback_depth', sa.Integer(), nullable=False),
    sa.Column('input_uncached_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cache_read_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cache_write_5m_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cache_write_1h_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('reasoning_tokens', sa.BigInteger(), nullable=False),
    sa.Column('ttft_ms', sa.Integer(), nullable=True),
    sa.Column('duration_ms', sa.Integer(), nullable=True),
    sa.Column('provider_cost_reported', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('litellm_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('provider_cost_computed', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('provider_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('absorbed_cost', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('cost_source', sa.String(length=40), nullable=False),
    sa.Column('cost_rate_id', sa.Integer(), nullable=True),
    sa.Column('price_book_id', sa.Integer(), nullable=True),
    sa.Column('price_book_version', sa.Integer(), nullable=True),
    sa.Column('price_rule_id', sa.Integer(), nullable=True),
    sa.Column('markup_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('surcharge_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('fee_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('billed_amount', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('raw_usage', sa.JSON(), nullable=True),
    sa.Column('router_attempts', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('event_id', name=op.f('pk_usage_event'))
    )
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.create_index('ix_usage_event_booked', ['booked_period', 'app_id'], unique=False)

    op.create_table('cost_rate',
    sa.Column('cost_rate_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('backend_id', sa.String(length=200), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('input_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('cache_read_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('cache_write_5m_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('cache_write_1h_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('output_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('reasoning_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('per_request', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('source', sa.String(length=40), nullable=False),
    sa.Column('effective_from', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.Column('effective_to', kvroute.billing.models.Tz(timezone=True), nullable=True),
    sa.Column('created_at', kvroute.billing.models.Tz(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['backend_id'], ['backend.backend_id'], name=op.f('fk_cost_rate_backend_id_backend')),
    sa.PrimaryKeyConstraint('cost_rate_id', name=op.f('pk_cost_rate')),
    sa.UniqueConstraint('backend_id', 'effective_from', name=op.f('uq_cost_rate_backend_id'))
    )
    op.create_table('price_rule',
    sa.Column('price_rule_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('price_book_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('match_provider', sa.String(length=100), nullable=True),
    sa.Column('match_model', sa.String(length=200), nullable=True),
    sa.Column('match_backend', sa.String(length=200), nullable=True),
    sa.Column('match_route_kind', sa.String(length=20), nullable=True),
    sa.Column('markup_pct', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('surcharge_input_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('surcharge_cache_read_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('surcharge_cache_write_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('surcharge_output_per_mtok', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('fee_per_request', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('min_charge_per_request', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('max_charge_per_request', kvroute.billing.models.Money(precision=38, scale=10), nullable=True),
    sa.Column('bill_failed_attempts', sa.Boolean(), nullable=False),
    sa.Column('bill_zero_completion', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['price_book_id'], ['price_book.price_book_id'],
                            name=op.f('fk_price_rule_price_book_id_price_book')),
    sa.PrimaryKeyConstraint('price_rule_id', name=op.f('pk_price_rule'))
    )
    with op.batch_alter_table('price_rule', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_price_rule_price_book_id'), ['price_book_id'], unique=False)

    op.create_table('statement_line',
    sa.Column('line_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('statement_id', sa.Integer(), nullable=False),
    sa.Column('group_key', sa.String(length=600), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('quantity', sa.BigInteger(), nullable=False),
    sa.Column('unit', sa.String(length=20), nullable=False),
    sa.Column('amount_unrounded', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('amount_rounded', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.Column('rounding_residual', kvroute.billing.models.Money(precision=38, scale=10), nullable=False),
    sa.ForeignKeyConstraint(['statement_id'], ['statement.statement_id'],
                            name=op.f('fk_statement_line_statement_id_statement')),
    sa.PrimaryKeyConstraint('line_id', name=op.f('pk_statement_line'))
    )
    with op.batch_alter_table('statement_line', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_statement_line_statement_id'), ['statement_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('statement_line', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_statement_line_statement_id'))

    op.drop_table('statement_line')
    with op.batch_alter_table('price_rule', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_price_rule_price_book_id'))

    op.drop_table('price_rule')
    op.drop_table('cost_rate')
    with op.batch_alter_table('usage_event', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_event_booked')

    op.drop_table('usage_event')
    with op.batch_alter_table('usage_adjustment', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_adjustment_period')

    op.drop_table('usage_adjustment')
    op.drop_table('statement')
    op.drop_table('price_book')
    op.drop_table('payout')
    op.drop_table('billing_period')
    op.drop_table('backend')
