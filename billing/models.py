"""SQLAlchemy 2 tables of the ledger. Append-only: corrections are new rows; the one exception is
a recorded re-rate (``rerate_run``) of an open month, which re-prices its events in place and marks them.

Money columns use ``Money``: ``NUMERIC(38, 10)`` on PostgreSQL; on SQLite, whose NUMERIC affinity would coerce
decimals to binary floats, the same column holds exact integer units of 1e-10 so sums stay exact in SQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from kvroute.billing.money import fix, from_units, to_units


class Money(TypeDecorator):
    """Exact decimal amounts: NUMERIC(38,10) where the database has it, integer 1e-10 units on SQLite."""

    impl = Numeric(38, 10)
    cache_ok = True

    def load_dialect_impl(self, dialect: Any) -> Any:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(BigInteger())
        return dialect.type_descriptor(Numeric(38, 10, asdecimal=True))

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, Decimal):
            if isinstance(value, float):
                raise TypeError("Money never takes a float; pass a Decimal")
            value = Decimal(value)
        return to_units(value) if dialect.name == "sqlite" else fix(value)

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return from_units(int(value))
        return fix(Decimal(value))


class Tz(TypeDecorator):
    """Timezone-aware UTC datetimes on every dialect (SQLite keeps them naive in UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


NAMING = {"ix": "ix_%(column_0_label)s", "uq": "uq_%(table_name)s_%(column_0_name)s",
          "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s", "pk": "pk_%(table_name)s"}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Backend(Base):
    __tablename__ = "backend"
    backend_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    provider: Mapped[str] = mapped_column(String(100))
    served_model: Mapped[str | None] = mapped_column(String(200))
    endpoint: Mapped[str | None] = mapped_column(String(500))
    route_kind: Mapped[str] = mapped_column(String(20), default="direct")
    created_at: Mapped[datetime] = mapped_column(Tz())
    # set by a price file: its provider and route kind are then the backend's, for every event rated after
    declared_at: Mapped[datetime | None] = mapped_column(Tz())
    # what its provider bills for a call the client walked away from (``kvroute.billing.cancels``); None: the
    # provider's known mode
    cancel_billing: Mapped[str | None] = mapped_column(String(10))


class CostRateRow(Base):
    __tablename__ = "cost_rate"
    __table_args__ = (UniqueConstraint("backend_id", "effective_from"),)
    cost_rate_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    backend_id: Mapped[str] = mapped_column(ForeignKey("backend.backend_id"))
    currency: Mapped[str] = mapped_column(String(3))
    input_per_mtok: Mapped[Decimal] = mapped_column(Money())
    cache_read_per_mtok: Mapped[Decimal] = mapped_column(Money())
    cache_write_5m_per_mtok: Mapped[Decimal] = mapped_column(Money())
    cache_write_1h_per_mtok: Mapped[Decimal] = mapped_column(Money())
    output_per_mtok: Mapped[Decimal] = mapped_column(Money())
    reasoning_per_mtok: Mapped[Decimal | None] = mapped_column(Money())
    per_request: Mapped[Decimal] = mapped_column(Money())
    # a GPU card's measured prefill throughput (tokens/s per replica; an exact decimal in Money's storage, not money):
    # what prefill seconds a cache read saved. NULL: not a GPU card, or loaded before 0005
    prefill_tok_s: Mapped[Decimal | None] = mapped_column(Money())
    source: Mapped[str] = mapped_column(String(40))
    effective_from: Mapped[datetime] = mapped_column(Tz())
    effective_to: Mapped[datetime | None] = mapped_column(Tz())
    created_at: Mapped[datetime] = mapped_column(Tz())


class PriceBookRow(Base):
    __tablename__ = "price_book"
    __table_args__ = (UniqueConstraint("app_key", "version"),)
    price_book_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    app_id: Mapped[str | None] = mapped_column(String(200))
    app_key: Mapped[str] = mapped_column(String(200))  # app_id, or '*' for the default book (unique-able)
    currency: Mapped[str] = mapped_column(String(3))
    version: Mapped[int] = mapped_column(Integer)
    effective_from: Mapped[datetime] = mapped_column(Tz())
    effective_to: Mapped[datetime | None] = mapped_column(Tz())
    status: Mapped[str] = mapped_column(String(20), default="active")
    platform_fee_pct: Mapped[Decimal] = mapped_column(Money())
    payment_fee_pct: Mapped[Decimal] = mapped_column(Money())
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(Tz())


class PriceRuleRow(Base):
    __tablename__ = "price_rule"
    price_rule_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    price_book_id: Mapped[int] = mapped_column(ForeignKey("price_book.price_book_id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    currency: Mapped[str] = mapped_column(String(3))  # the book's; repeated so every money row names it
    priority: Mapped[int] = mapped_column(Integer)
    match_provider: Mapped[str | None] = mapped_column(String(100))
    match_model: Mapped[str | None] = mapped_column(String(200))
    match_backend: Mapped[str | None] = mapped_column(String(200))
    match_route_kind: Mapped[str | None] = mapped_column(String(20))
    markup_pct: Mapped[Decimal | None] = mapped_column(Money())
    surcharge_input_per_mtok: Mapped[Decimal | None] = mapped_column(Money())
    surcharge_cache_read_per_mtok: Mapped[Decimal | None] = mapped_column(Money())
    surcharge_cache_write_per_mtok: Mapped[Decimal | None] = mapped_column(Money())
    surcharge_output_per_mtok: Mapped[Decimal | None] = mapped_column(Money())
    fee_per_request: Mapped[Decimal | None] = mapped_column(Money())
    min_charge_per_request: Mapped[Decimal | None] = mapped_column(Money())
    max_charge_per_request: Mapped[Decimal | None] = mapped_column(Money())
    bill_failed_attempts: Mapped[bool] = mapped_column(Boolean, default=False)
    bill_zero_completion: Mapped[bool] = mapped_column(Boolean, default=False)
    bill_cancelled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    bill_hedge_lost: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class UsageEventRow(Base):
    __tablename__ = "usage_event"
    __table_args__ = (Index("ix_usage_event_booked", "booked_period", "app_id"),)
    event_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # unique: insert-or-ignore
    request_id: Mapped[str] = mapped_column(String(200))
    attempt_no: Mapped[int] = mapped_column(Integer)
    is_final_attempt: Mapped[bool] = mapped_column(Boolean)
    app_id: Mapped[str] = mapped_column(String(200))
    end_user_id: Mapped[str | None] = mapped_column(String(200))
    api_key_hash: Mapped[str | None] = mapped_column(String(128))
    occurred_at: Mapped[datetime] = mapped_column(Tz())
    received_at: Mapped[datetime] = mapped_column(Tz())
    period: Mapped[str] = mapped_column(String(7))          # by occurred_at
    booked_period: Mapped[str] = mapped_column(String(7))   # where it counts; differs for late events
    requested_model: Mapped[str | None] = mapped_column(String(200))
    served_model: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(100))
    backend_id: Mapped[str] = mapped_column(String(200))
    route_kind: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20))
    http_status: Mapped[int | None] = mapped_column(Integer)
    error_type: Mapped[str | None] = mapped_column(String(100))
    streamed: Mapped[bool] = mapped_column(Boolean)
    sticky_hit: Mapped[bool] = mapped_column(Boolean)
    fallback_depth: Mapped[int] = mapped_column(Integer)
    input_uncached_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_read_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_5m_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_1h_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    ttft_ms: Mapped[int | None] = mapped_column(Integer)
    duration_ms: Mapped[int | None] = mapped_column(Integer)
    provider_cost_reported: Mapped[Decimal | None] = mapped_column(Money())
    litellm_cost: Mapped[Decimal | None] = mapped_column(Money())
    provider_cost_computed: Mapped[Decimal | None] = mapped_column(Money())
    provider_cost: Mapped[Decimal] = mapped_column(Money())
    absorbed_cost: Mapped[Decimal] = mapped_column(Money())
    cost_source: Mapped[str] = mapped_column(String(40))
    cost_rate_id: Mapped[int | None] = mapped_column(Integer)
    price_book_id: Mapped[int | None] = mapped_column(Integer)
    price_book_version: Mapped[int | None] = mapped_column(Integer)
    price_rule_id: Mapped[int | None] = mapped_column(Integer)
    markup_amount: Mapped[Decimal] = mapped_column(Money())
    surcharge_amount: Mapped[Decimal] = mapped_column(Money())
    fee_amount: Mapped[Decimal] = mapped_column(Money())
    billed_amount: Mapped[Decimal] = mapped_column(Money())
    currency: Mapped[str] = mapped_column(String(3))
    raw_usage: Mapped[Any | None] = mapped_column(JSON)
    router_attempts: Mapped[Any | None] = mapped_column(JSON)
    rerate_run_id: Mapped[int | None] = mapped_column(Integer)  # the re-rate run that last re-priced it in place
    session_id: Mapped[str | None] = mapped_column(String(200))  # the client's session (header or metadata)


class UsageEventTagRow(Base):
    """One tag of one event (request metadata ``tags``; never prompt text): ``--by tag`` groups on it."""

    __tablename__ = "usage_event_tag"
    event_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tag: Mapped[str] = mapped_column(String(100), primary_key=True)


class UsageAdjustmentRow(Base):
    __tablename__ = "usage_adjustment"
    __table_args__ = (Index("ix_usage_adjustment_period", "period", "app_id"),)
    adjustment_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # deterministic: idempotent
    event_id: Mapped[str | None] = mapped_column(String(32))
    app_id: Mapped[str] = mapped_column(String(200))
    period: Mapped[str] = mapped_column(String(7))
    original_period: Mapped[str | None] = mapped_column(String(7))
    kind: Mapped[str] = mapped_column(String(30))
    delta_provider_cost: Mapped[Decimal] = mapped_column(Money())
    delta_absorbed_cost: Mapped[Decimal] = mapped_column(Money())
    delta_billed_amount: Mapped[Decimal] = mapped_column(Money())
    delta_markup_amount: Mapped[Decimal] = mapped_column(Money())
    delta_tokens: Mapped[Any | None] = mapped_column(JSON)
    currency: Mapped[str] = mapped_column(String(3))
    reason: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(Tz())
    rerate_run_id: Mapped[int | None] = mapped_column(Integer)  # kind ``rerate``: the run that booked it


class RerateRunRow(Base):
    """One applied ``kvroute billing rerate``: who re-priced which month when, and what changed."""

    __tablename__ = "rerate_run"
    rerate_run_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    period: Mapped[str] = mapped_column(String(7))
    app_id: Mapped[str | None] = mapped_column(String(200))  # None: every app
    created_by: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(Tz())
    events_rerated: Mapped[int] = mapped_column(Integer)  # open month: re-priced in place
    adjustments_booked: Mapped[int] = mapped_column(Integer)  # closed month: ``rerate`` adjustments
    summary: Mapped[Any] = mapped_column(JSON)  # the diff per app × backend (old and new amounts as text)


class BillingPeriodRow(Base):
    __tablename__ = "billing_period"
    app_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)
    status: Mapped[str] = mapped_column(String(10))  # open | closing | closed
    grace_until: Mapped[datetime | None] = mapped_column(Tz())
    closed_at: Mapped[datetime | None] = mapped_column(Tz())
    totals_hash: Mapped[str | None] = mapped_column(String(64))


class StatementRow(Base):
    __tablename__ = "statement"
    __table_args__ = (UniqueConstraint("app_id", "period", "currency"),)
    statement_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    app_id: Mapped[str] = mapped_column(String(200))
    period: Mapped[str] = mapped_column(String(7))
    currency: Mapped[str] = mapped_column(String(3))
    price_book_version_set: Mapped[Any | None] = mapped_column(JSON)
    subtotal_billed: Mapped[Decimal] = mapped_column(Money())
    adjustments_total: Mapped[Decimal] = mapped_column(Money())
    total_billed: Mapped[Decimal] = mapped_column(Money())
    total_unrounded: Mapped[Decimal] = mapped_column(Money())
    provider_cost_total: Mapped[Decimal] = mapped_column(Money())
    absorbed_cost_total: Mapped[Decimal] = mapped_column(Money())
    platform_fee: Mapped[Decimal] = mapped_column(Money())
    payment_fee: Mapped[Decimal] = mapped_column(Money())
    margin_total: Mapped[Decimal] = mapped_column(Money())
    created_at: Mapped[datetime] = mapped_column(Tz())
    finalized_at: Mapped[datetime | None] = mapped_column(Tz())


class StatementLineRow(Base):
    __tablename__ = "statement_line"
    line_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    statement_id: Mapped[int] = mapped_column(ForeignKey("statement.statement_id"), index=True)
    group_key: Mapped[str] = mapped_column(String(600))
    currency: Mapped[str] = mapped_column(String(3))
    quantity: Mapped[int] = mapped_column(BigInteger)
    unit: Mapped[str] = mapped_column(String(20))
    amount_unrounded: Mapped[Decimal] = mapped_column(Money())
    amount_rounded: Mapped[Decimal] = mapped_column(Money())
    rounding_residual: Mapped[Decimal] = mapped_column(Money())


class PayoutRow(Base):
    __tablename__ = "payout"
    __table_args__ = (UniqueConstraint("app_id", "period", "currency"),)
    payout_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    builder_id: Mapped[str] = mapped_column(String(200))
    app_id: Mapped[str] = mapped_column(String(200))
    period: Mapped[str] = mapped_column(String(7))
    currency: Mapped[str] = mapped_column(String(3))
    gross_billed: Mapped[Decimal] = mapped_column(Money())
    provider_cost: Mapped[Decimal] = mapped_column(Money())
    absorbed_cost: Mapped[Decimal] = mapped_column(Money())
    platform_fee: Mapped[Decimal] = mapped_column(Money())
    payment_fee: Mapped[Decimal] = mapped_column(Money())
    markup_earned: Mapped[Decimal] = mapped_column(Money())  # markup and surcharges (fees: fee_amount)
    fee_amount: Mapped[Decimal | None] = mapped_column(Money())  # per-request fees; NULL on payouts before 0002
    payout_amount: Mapped[Decimal] = mapped_column(Money())
    status: Mapped[str] = mapped_column(String(10))
    external_ref: Mapped[str | None] = mapped_column(String(200))
    paid_at: Mapped[datetime | None] = mapped_column(Tz())
