"""``Catalog``: the price books and rate cards in force, loaded from the ledger, looked up per event."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Connection, select

from kvroute.billing.events import UsageEvent
from kvroute.billing.models import Backend, CostRateRow, PriceBookRow, PriceRuleRow
from kvroute.billing.pricing import CostRate, PriceBook, PriceRule

DEFAULT_APP = "*"


@dataclass(frozen=True, slots=True)
class BackendIdentity:
    """Who a backend is for billing: its provider and route kind (``self_hosted``/``marketplace``/``direct``)."""

    provider: str
    route_kind: str
    cancel_billing: str | None = None  # what the provider bills for a cancelled call (None: its known mode)


class Catalog:
    """Versioned price books per app (plus the default book) and rate cards per backend, in memory."""

    def __init__(self, books: list[PriceBook], rates: list[CostRate],
                 backends: Mapping[str, BackendIdentity] | None = None) -> None:
        self.backends: dict[str, BackendIdentity] = dict(backends or {})
        self._books: dict[str, list[PriceBook]] = defaultdict(list)
        for book in books:
            self._books[book.app_id or DEFAULT_APP].append(book)
        for items in self._books.values():
            items.sort(key=lambda b: (b.effective_from, b.version))
        self._book_starts = {k: [b.effective_from for b in v] for k, v in self._books.items()}
        self._rates: dict[str, list[CostRate]] = defaultdict(list)
        for rate in rates:
            self._rates[rate.backend_id].append(rate)
        for items in self._rates.values():
            items.sort(key=lambda r: r.effective_from)
        self._rate_starts = {k: [r.effective_from for r in v] for k, v in self._rates.items()}
        self.rules_by_id = {r.price_rule_id: (b, r) for b in books for r in b.rules}
        self.rates_by_id = {r.cost_rate_id: r for r in rates if r.cost_rate_id is not None}

    def book_for(self, app_id: str, at: datetime) -> PriceBook | None:
        """The app's book in force at ``at`` (latest version that started by then), else the default book."""
        for key in (app_id, DEFAULT_APP):
            starts = self._book_starts.get(key)
            if starts:
                i = bisect_right(starts, at)
                if i:
                    return self._books[key][i - 1]
        return None

    def rate_for(self, backend_id: str, at: datetime) -> CostRate | None:
        starts = self._rate_starts.get(backend_id)
        if not starts:
            return None
        i = bisect_right(starts, at)
        return self._rates[backend_id][i - 1] if i else None

    def identity(self, backend_id: str) -> BackendIdentity | None:
        """The provider and route kind a price file declared for ``backend_id`` (None: not declared)."""
        return self.backends.get(backend_id)

    def resolve(self, e: UsageEvent) -> UsageEvent:
        """``e`` with the declared provider and route kind of its backend: the price file names a backend once,
        and every event of it is rated, matched and reported under that name (undeclared: the event's own)."""
        found = self.backends.get(e.backend_id)
        if found is None or (found.provider == e.provider and found.route_kind == e.route_kind):
            return e
        return replace(e, provider=found.provider, route_kind=found.route_kind)

    @classmethod
    def load(cls, conn: Connection, declared: bool = True) -> Catalog:
        """Read every price book, rule and rate card, and (``declared``) the backends a price file declared."""
        rules: dict[int, list[PriceRule]] = defaultdict(list)
        query = select(PriceRuleRow.__table__).order_by(PriceRuleRow.priority, PriceRuleRow.price_rule_id)
        for r in conn.execute(query):
            surcharge = {k: v for k, v in (("input", r.surcharge_input_per_mtok),
                                           ("cache_read", r.surcharge_cache_read_per_mtok),
                                           ("cache_write", r.surcharge_cache_write_per_mtok),
                                           ("output", r.surcharge_output_per_mtok)) if v is not None}
            rules[r.price_book_id].append(PriceRule(
                r.name, r.priority, r.match_provider, r.match_model, r.match_backend, r.match_route_kind,
                r.markup_pct, surcharge, r.fee_per_request, r.min_charge_per_request, r.max_charge_per_request,
                r.bill_failed_attempts, r.bill_zero_completion, r.price_rule_id, bill_cancelled=r.bill_cancelled,
                bill_hedge_lost=r.bill_hedge_lost))
        books = [PriceBook(b.app_id, b.version, b.effective_from, b.currency, tuple(rules[b.price_book_id]),
                           b.platform_fee_pct, b.payment_fee_pct, b.price_book_id)
                 for b in conn.execute(select(PriceBookRow.__table__))]
        rates = [CostRate(c.backend_id, c.effective_from, c.currency, c.input_per_mtok, c.cache_read_per_mtok,
                          c.cache_write_5m_per_mtok, c.cache_write_1h_per_mtok, c.output_per_mtok,
                          c.reasoning_per_mtok, c.per_request, c.source, c.cost_rate_id, c.prefill_tok_s)
                 for c in conn.execute(select(CostRateRow.__table__))]
        backends = {b.backend_id: BackendIdentity(b.provider, b.route_kind, b.cancel_billing)
                    for b in conn.execute(select(Backend.backend_id, Backend.provider, Backend.route_kind,
                                                 Backend.cancel_billing)
                                          .where(Backend.declared_at.is_not(None)))} if declared else {}
        return cls(books, rates, backends)

    def platform_fee_pct(self, app_id: str, at: datetime) -> tuple[Decimal, Decimal]:
        book = self.book_for(app_id, at)
        return (book.platform_fee_pct, book.payment_fee_pct) if book else (Decimal(0), Decimal(0))
