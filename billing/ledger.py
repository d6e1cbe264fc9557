"""``Ledger``: rates usage events and appends them, idempotently, to the database (insert-or-ignore).

An event whose rating fails (currencies that differ, an amount beyond ``MAX_AMOUNT``) raises ``InputError``;
``Ledger.check_events`` finds such events before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, Table, select, text
from sqlalchemy.dialects import postgresql, sqlite

from kvroute.billing.catalog import Catalog
from kvroute.billing.db import open_engine
from kvroute.billing.events import UsageEvent, json_safe, period_of
from kvroute.billing.models import (
    Backend,
    BillingPeriodRow,
    Money,
    Tz,
    UsageAdjustmentRow,
    UsageEventRow,
    UsageEventTagRow,
)
from kvroute.billing.money import MAX_AMOUNT, fix
from kvroute.billing.pricing import rate_event
from kvroute.policies.errors import InputError

EVENT: Table = UsageEventRow.__table__  # type: ignore[assignment]
ADJUSTMENT: Table = UsageAdjustmentRow.__table__  # type: ignore[assignment]
BACKEND: Table = Backend.__table__  # type: ignore[assignment]
TAG: Table = UsageEventTagRow.__table__  # type: ignore[assignment]


def next_period(period: str) -> str:
    year, month = int(period[:4]), int(period[5:7])
    return f"{year + month // 12:04d}-{month % 12 + 1:02d}"


ALL_APPS = "*"


def is_closed(closed: set[tuple[str, str]], app_id: str, period: str) -> bool:
    """Whether ``period`` is closed for the app (or for every app)."""
    return (app_id, period) in closed or (ALL_APPS, period) in closed


def late_adjustment_id(event_id: str) -> str:
    return hashlib.sha256(f"late_event|{event_id}".encode()).hexdigest()[:32]


class Ledger:
    """The append-only usage ledger on one engine; safe to share between threads."""

    def __init__(self, engine: Engine, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 catalog_ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.clock = clock
        self._catalog: Catalog | None = None
        self._catalog_at = 0.0
        self._catalog_ttl = catalog_ttl_s
        self._lock = threading.Lock()
        self._known_backends: set[str] = set()
        dialect = engine.dialect.name
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert

    @classmethod
    def open(cls, url: str, **kwargs: Any) -> Ledger:
        """Open (and migrate) the database at ``url``."""
        return cls(open_engine(url), **kwargs)

    def close(self) -> None:
        self.engine.dispose()

    def catalog(self, refresh: bool = False) -> Catalog:
        """The price books and rate cards, reloaded after ``catalog_ttl_s`` or on ``refresh``."""
        with self._lock:
            if refresh or self._catalog is None or time.monotonic() - self._catalog_at > self._catalog_ttl:
                with self.engine.connect() as conn:
                    self._catalog = Catalog.load(conn)
                self._catalog_at = time.monotonic()
            return self._catalog

    def insert_events(self, events: Sequence[UsageEvent], rated: Sequence[dict[str, Any]] | None = None) -> int:
        """Rate and insert events in one transaction; events already present are ignored. Returns rows added.

        Events of a closed (app, period) are stored with ``booked_period`` set to the open period and get a
        ``late_event`` adjustment there (original period recorded). ``rated``: the rows ``rate_events`` made of
        these events (saves rating twice); raises ``InputError`` on the first event that cannot be rated.
        """
        if not events:
            return 0
        now = self.clock()
        if rated is None:
            catalog = self.catalog()
            rated = [event_row(e, catalog, now, period_of(e.occurred_at)) for e in events]
        with self.engine.begin() as conn:
            closed = self._closed_periods(conn, events)
            self._ensure_backends(conn, rated, now)
            rows, late = [], []
            for row in rated:
                period = row["period"]
                if is_closed(closed, row["app_id"], period):
                    booked = max(period_of(now), next_period(period))
                    while is_closed(closed, row["app_id"], booked):
                        booked = next_period(booked)
                    row = {**row, "booked_period": booked}
                    late.append(row)
                rows.append(row)
            if late:  # a closed period's event already stored (a replay) is not late again: skip it entirely
                ids = [r["event_id"] for r in late]
                present = {i for k in range(0, len(ids), 10000) for i in conn.execute(
                    select(EVENT.c.event_id).where(EVENT.c.event_id.in_(ids[k:k + 10000]))).scalars()}
                if present:
                    rows = [r for r in rows if r["event_id"] not in present]
                    late = [r for r in late if r["event_id"] not in present]
            if not rows:
                added = 0
            elif self.engine.dialect.name == "sqlite":
                added = _sqlite_insert(conn, rows)
            else:
                added = _postgres_insert(conn, rows)
            if late:
                conn.execute(self._insert(ADJUSTMENT).on_conflict_do_nothing(index_elements=["adjustment_id"]),
                             [late_adjustment(r, now) for r in late])
            tags = [{"event_id": e.event_id, "tag": t} for e in events for t in e.tags]
            if tags:
                conn.execute(self._insert(TAG).on_conflict_do_nothing(index_elements=["event_id", "tag"]), tags)
        return added

    def rate_events(self, events: Sequence[UsageEvent]) -> tuple[list[dict[str, Any] | None],
                                                                   list[tuple[int, InputError]]]:
        """Rate every event without writing: a row per event (``None`` where refused) and ``(index, error)``."""
        catalog = self.catalog()
        now = self.clock()
        rows: list[dict[str, Any] | None] = []
        errors = []
        for i, e in enumerate(events):
            try:
                rows.append(event_row(e, catalog, now, period_of(e.occurred_at)))
            except InputError as exc:
                rows.append(None)
                errors.append((i, exc))
        return rows, errors

    def check_events(self, events: Sequence[UsageEvent]) -> list[tuple[int, InputError]]:
        """``(index, error)`` for each event ``insert_events`` would refuse (currencies, amount limits)."""
        return self.rate_events(events)[1]

    def _closed_periods(self, conn: Connection, events: Iterable[UsageEvent]) -> set[tuple[str, str]]:
        if self.engine.dialect.name == "postgresql":  # close-period takes a conflicting lock (see periods.py)
            conn.execute(text("LOCK TABLE billing_period IN SHARE MODE"))
        apps = sorted({e.app_id for e in events} | {ALL_APPS})
        bp = BillingPeriodRow
        found = conn.execute(select(bp.app_id, bp.period).where(bp.status == "closed", bp.app_id.in_(apps)))
        return {(a, p) for a, p in found}

    def _ensure_backends(self, conn: Connection, rows: Iterable[dict[str, Any]], now: datetime) -> None:
        """A ``backend`` row for each backend first seen in an event (a price file's declaration is never changed)."""
        new = {}
        for r in rows:
            backend = r["backend_id"]
            if backend not in self._known_backends and backend not in new:
                new[backend] = {"backend_id": backend, "provider": r["provider"], "served_model": r["served_model"],
                                "endpoint": None, "route_kind": r["route_kind"], "created_at": now}
        if new:
            conn.execute(self._insert(BACKEND).on_conflict_do_nothing(index_elements=["backend_id"]),
                         list(new.values()))
            self._known_backends.update(new)

    def count_events(self) -> int:
        from sqlalchemy import func
        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(EVENT)).scalar_one()


def event_row(e: UsageEvent, catalog: Catalog, now: datetime, period: str,
              booked_period: str | None = None) -> dict[str, Any]:
    """The ``usage_event`` row of a rated event (booked in its own period unless ``booked_period`` says); the
    backend's provider and route kind are the catalog's when a price file declared it (``Catalog.resolve``)."""
    e = catalog.resolve(e)
    r = rate_event(e, catalog.rate_for(e.backend_id, e.occurred_at), catalog.book_for(e.app_id, e.occurred_at))
    amounts = {"provider_cost": e.provider_cost, "litellm_cost": e.litellm_cost,
               "provider_cost_computed": r.provider_cost_computed, "markup_amount": r.markup_amount,
               "surcharge_amount": r.surcharge_amount, "fee_amount": r.fee_amount, "billed_amount": r.billed_amount}
    for name, amount in amounts.items():
        if amount is not None and abs(amount) > MAX_AMOUNT:
            raise InputError(name, f"{amount} {r.currency} exceeds the ledger's limit of {MAX_AMOUNT} per event")
    t = e.tokens
    return {
        "event_id": e.event_id, "request_id": e.request_id, "attempt_no": e.attempt, "is_final_attempt": e.is_final,
        "app_id": e.app_id, "end_user_id": e.end_user, "api_key_hash": e.api_key_hash,
        "occurred_at": e.occurred_at, "received_at": now, "period": period,
        "booked_period": period if booked_period is None else booked_period,
        "requested_model": e.requested_model, "served_model": e.served_model, "provider": e.provider,
        "backend_id": e.backend_id, "route_kind": e.route_kind, "status": e.status, "http_status": e.http_status,
        "error_type": e.error_type, "streamed": e.streamed, "sticky_hit": e.sticky_hit,
        "fallback_depth": e.fallback_depth, "input_uncached_tokens": t.input_uncached,
        "cache_read_tokens": t.cache_read, "cache_write_5m_tokens": t.cache_write_5m,
        "cache_write_1h_tokens": t.cache_write_1h, "output_tokens": t.output, "reasoning_tokens": t.reasoning,
        "ttft_ms": e.ttft_ms, "duration_ms": e.duration_ms,
        "provider_cost_reported": None if e.provider_cost is None else fix(e.provider_cost),
        "litellm_cost": None if e.litellm_cost is None else fix(e.litellm_cost),
        "provider_cost_computed": r.provider_cost_computed,
        "provider_cost": r.provider_cost, "absorbed_cost": r.absorbed_cost, "cost_source": r.cost_source,
        "cost_rate_id": r.cost_rate_id, "price_book_id": r.price_book_id, "price_book_version": r.price_book_version,
        "price_rule_id": r.price_rule_id, "markup_amount": r.markup_amount, "surcharge_amount": r.surcharge_amount,
        "fee_amount": r.fee_amount, "billed_amount": r.billed_amount, "currency": r.currency,
        "raw_usage": None if e.raw_usage is None else json_safe(e.raw_usage),
        "router_attempts": None if e.router_attempts is None else json_safe(e.router_attempts),
        "rerate_run_id": None, "session_id": e.session_id,
    }


def late_adjustment(row: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A ``late_event`` adjustment booking a closed period's event into the open period."""
    return {
        "adjustment_id": late_adjustment_id(row["event_id"]), "event_id": row["event_id"], "app_id": row["app_id"],
        "period": row["booked_period"], "original_period": row["period"], "kind": "late_event",
        "delta_provider_cost": row["provider_cost"] - row["absorbed_cost"],
        "delta_absorbed_cost": row["absorbed_cost"], "delta_billed_amount": row["billed_amount"],
        "delta_markup_amount": row["markup_amount"] + row["surcharge_amount"],  # fee = billed - cost - markup
        "delta_tokens": {k: row[k] for k in ("input_uncached_tokens", "cache_read_tokens", "cache_write_5m_tokens",
                                             "cache_write_1h_tokens", "output_tokens", "reasoning_tokens")},
        "currency": row["currency"], "reason": f"event of closed period {row['period']} arrived late",
        "created_by": "ledger", "created_at": now,
    }


_COLUMNS = [c.name for c in EVENT.columns]
_MONEY_IDX = [i for i, c in enumerate(EVENT.columns) if isinstance(c.type, Money)]
_TIME_IDX = [i for i, c in enumerate(EVENT.columns) if isinstance(c.type, Tz)]
_JSON_IDX = [_COLUMNS.index("raw_usage"), _COLUMNS.index("router_attempts")]
_SQLITE_INSERT = (f"INSERT INTO usage_event ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                  "ON CONFLICT (event_id) DO NOTHING")


def _sqlite_insert(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """The SQLite hot path: one ``executemany`` of tuples encoded like the ``Money``/``Tz`` column types
    (integer 1e-10 units; naive-UTC ``YYYY-MM-DD HH:MM:SS.ffffff``), without per-value SQLAlchemy processing."""
    params = []
    stamps: dict[datetime, str] = {}  # received_at is shared by the batch
    for row in rows:
        values = [row[n] for n in _COLUMNS]
        for i in _MONEY_IDX:  # every amount in a row is already at scale 1e-10 (fix), so this is exact
            v = values[i]
            if v is not None:
                values[i] = int(v.scaleb(10))
        for i in _TIME_IDX:
            v = values[i]
            if v is not None:
                text_value = stamps.get(v)
                if text_value is None:
                    text_value = v.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
                    if len(stamps) < 4:
                        stamps[v] = text_value
                values[i] = text_value
        for i in _JSON_IDX:
            v = values[i]
            if v is not None:
                values[i] = json.dumps(v)
        params.append(values)
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(_SQLITE_INSERT, params)
        return max(cursor.rowcount, 0)
    finally:
        cursor.close()


_PG_INSERT = (f"INSERT INTO usage_event ({', '.join(_COLUMNS)}) VALUES ({', '.join(['%s'] * len(_COLUMNS))}) "
              "ON CONFLICT (event_id) DO NOTHING")


def _postgres_insert(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """PostgreSQL: psycopg ``executemany`` (pipelined, one prepared statement); rowcount sums inserted rows."""
    from psycopg.types.json import Json
    params = []
    for row in rows:
        values = [row[n] for n in _COLUMNS]
        for i in _MONEY_IDX:
            v = values[i]
            if v is not None:
                values[i] = fix(v)
        for i in _JSON_IDX:
            v = values[i]
            if v is not None:
                values[i] = Json(v)
        params.append(values)
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(_PG_INSERT, params)
        return max(cursor.rowcount, 0)
    finally:
        cursor.close()
