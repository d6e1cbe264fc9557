"""Store a validated price file in the ledger: new versions are added, identical ones skipped, changed ones refused.

Backends are declarations, not versions: the file's provider and route kind replace what the ledger knew of a
backend (e.g. a row first seen in an event), and every event rated afterwards carries them (``Catalog.resolve``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import insert, select, update

from kvroute.billing.ledger import Ledger
from kvroute.billing.models import Backend, CostRateRow, PriceBookRow, PriceRuleRow
from kvroute.billing.money import fix
from kvroute.billing.price_file import PriceFile, book_hash
from kvroute.policies.errors import ConfigError


@dataclass(frozen=True)
class LoadSummary:
    backends_added: int
    rates_added: int
    books_added: int
    books_unchanged: int
    backends_updated: int = 0


def store_prices(ledger: Ledger, pf: PriceFile) -> LoadSummary:
    """Insert everything new in one transaction; a changed book under an existing version is a ``ConfigError``."""
    now = datetime.now(UTC)
    backends_added = backends_updated = rates_added = books_added = unchanged = 0
    with ledger.engine.begin() as conn:
        known = {r.backend_id: r for r in conn.execute(select(Backend.__table__))}
        for b in pf.backends:
            declared = {"provider": b.provider, "served_model": b.served_model, "endpoint": b.endpoint,
                        "route_kind": b.route_kind, "cancel_billing": b.cancel_billing}
            old = known.get(b.backend_id)
            if old is None:
                conn.execute(insert(Backend).values(backend_id=b.backend_id, created_at=now, declared_at=now,
                                                    **declared))
                backends_added += 1
            elif old.declared_at is None or any(getattr(old, k) != v for k, v in declared.items()):
                conn.execute(update(Backend).where(Backend.backend_id == b.backend_id)
                             .values(declared_at=now, **declared))
                backends_updated += 1
        existing_rates = {(r.backend_id, r.effective_from): r
                          for r in conn.execute(select(CostRateRow.__table__))}
        for r in pf.rates:
            old = existing_rates.get((r.backend_id, r.effective_from))
            values = {"input_per_mtok": r.input_per_mtok, "cache_read_per_mtok": r.cache_read_per_mtok,
                      "cache_write_5m_per_mtok": r.cache_write_5m_per_mtok,
                      "cache_write_1h_per_mtok": r.cache_write_1h_per_mtok, "output_per_mtok": r.output_per_mtok,
                      "reasoning_per_mtok": r.reasoning_per_mtok, "per_request": r.per_request}
            if old is not None:
                stored = {k: getattr(old, k) for k in values}
                if any((stored[k] is None) != (v is None) or (v is not None and fix(v) != stored[k])
                       for k, v in values.items()) or old.currency != r.currency:
                    raise ConfigError(f"backends[{r.backend_id}].rates[{r.effective_from.date()}]",
                                      "a different rate card already starts at this time; add a new effective_from "
                                      "instead of editing history")
                if old.prefill_tok_s is None and r.prefill_tok_s is not None:  # a card loaded before 0005: its
                    conn.execute(update(CostRateRow).where(  # throughput is a fact to add, no price changes
                        CostRateRow.cost_rate_id == old.cost_rate_id).values(prefill_tok_s=r.prefill_tok_s))
                continue
            conn.execute(insert(CostRateRow).values(backend_id=r.backend_id, currency=r.currency, source=r.source,
                                                    effective_from=r.effective_from, effective_to=None,
                                                    prefill_tok_s=r.prefill_tok_s, created_at=now, **values))
            rates_added += 1
        existing_books = {(b.app_key, b.version): b for b in conn.execute(select(PriceBookRow.__table__))}
        for book in pf.books:
            digest = book_hash(book)
            old = existing_books.get((book.app_id or "*", book.version))
            if old is not None:
                if old.content_hash != digest:
                    raise ConfigError(f"price_books[{book.app_id or 'default'} v{book.version}]",
                                      "this version is already loaded with different terms; bump the version")
                unchanged += 1
                continue
            book_id = conn.execute(insert(PriceBookRow).values(
                app_id=book.app_id, app_key=book.app_id or "*", currency=book.currency, version=book.version,
                effective_from=book.effective_from, effective_to=None, status="active",
                platform_fee_pct=book.platform_fee_pct, payment_fee_pct=book.payment_fee_pct,
                content_hash=digest, created_at=now).returning(PriceBookRow.price_book_id)).scalar_one()
            for rule in book.rules:
                s = rule.surcharge_per_mtok
                conn.execute(insert(PriceRuleRow).values(
                    price_book_id=book_id, name=rule.name, currency=book.currency, priority=rule.priority,
                    match_provider=rule.match_provider,
                    match_model=rule.match_model, match_backend=rule.match_backend,
                    match_route_kind=rule.match_route_kind, markup_pct=rule.markup_pct,
                    surcharge_input_per_mtok=s.get("input"), surcharge_cache_read_per_mtok=s.get("cache_read"),
                    surcharge_cache_write_per_mtok=s.get("cache_write"), surcharge_output_per_mtok=s.get("output"),
                    fee_per_request=rule.fee_per_request, min_charge_per_request=rule.min_per_request,
                    max_charge_per_request=rule.max_per_request, bill_failed_attempts=rule.bill_failed_attempts,
                    bill_zero_completion=rule.bill_zero_completion, bill_cancelled=rule.bill_cancelled,
                    bill_hedge_lost=rule.bill_hedge_lost))
            books_added += 1
    ledger.catalog(refresh=True)
    return LoadSummary(backends_added, rates_added, books_added, unchanged, backends_updated)
