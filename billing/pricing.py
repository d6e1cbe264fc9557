"""Rate cards (what a backend costs us) and price books (what an app pays), and rating one event.

Formulas, all in ``Decimal`` at scale 1e-10, never rounded to cents here:
``provider_cost`` = reported cost, else LiteLLM's cost before its margin, else Σ tokens × rate / 1e6 + per_request;
a self-hosted amortised card (``source="self_hosted_amortized"``, e.g. a ``GpuRateCard``) comes before LiteLLM's
cost (which for a replica is only the per-token price typed into ``model_list``), so the card is the one unit of
self-hosted cost the ledger and the hybrid router share;
``billed`` = clamp(cost + cost × markup + Σ tokens × surcharge / 1e6 + fee, min, max), or 0 for non-final attempts
unless the rule has ``bill_failed_attempts`` and for zero completions unless it has ``bill_zero_completion`` (a
retried zero completion needs both); a request its client walked away from (a final ``cancelled`` attempt) is
billed like an answer unless the rule sets ``bill_cancelled: false``; a hedge's losing attempt only under
``bill_hedge_lost``.

Currencies are never mixed: the amounts an event is rated with (its reported cost in the event's ``currency``,
or the rate card in the card's currency) must be in the price book's currency, else ``rate_event`` raises
``InputError`` (no conversion). A backend with neither a reported cost nor a rate card is rated at cost 0
with ``cost_source="unknown"``; reports flag such events as unpriced. A ``no_route`` event called no backend:
there is nothing to price (cost 0, ``cost_source="not_called"``, never unpriced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from fnmatch import fnmatchcase

from kvroute.billing.cancels import HEDGE_LOST
from kvroute.billing.events import UsageEvent
from kvroute.billing.money import MILLION, ZERO, check_currency, fix, to_decimal
from kvroute.billing.usage import TokenBuckets
from kvroute.policies.errors import InputError

NOT_CALLED = "not_called"  #: the cost source of an event that reached no backend

#: Surcharge buckets of a price rule and the token buckets each one applies to.
SURCHARGE_BUCKETS = {"input": ("input_uncached",), "cache_read": ("cache_read",),
                     "cache_write": ("cache_write_5m", "cache_write_1h"), "output": ("output",)}


@dataclass(frozen=True, slots=True)
class CostRate:
    """A versioned rate card of one backend, per million tokens (self-hosted: amortised GPU cost)."""

    backend_id: str
    effective_from: datetime
    currency: str = "USD"
    input_per_mtok: Decimal = ZERO
    cache_read_per_mtok: Decimal = ZERO
    cache_write_5m_per_mtok: Decimal = ZERO
    cache_write_1h_per_mtok: Decimal = ZERO
    output_per_mtok: Decimal = ZERO
    reasoning_per_mtok: Decimal | None = None
    per_request: Decimal = ZERO
    source: str = "manual"
    cost_rate_id: int | None = None
    #: a GPU card's measured prefill throughput (tokens per second per replica); None for any other card
    prefill_tok_s: Decimal | None = None

    def cost(self, t: TokenBuckets) -> Decimal:
        """Σ tokens × rate / 1e6 + per-request cost; reasoning tokens use their own rate when set."""
        output_rate = self.output_per_mtok
        total = (t.input_uncached * self.input_per_mtok + t.cache_read * self.cache_read_per_mtok
                 + t.cache_write_5m * self.cache_write_5m_per_mtok + t.cache_write_1h * self.cache_write_1h_per_mtok)
        if self.reasoning_per_mtok is not None:
            total += (t.output - t.reasoning) * output_rate + t.reasoning * self.reasoning_per_mtok
        else:
            total += t.output * output_rate
        return total / MILLION + self.per_request

    def per_token(self) -> tuple[Decimal, Decimal]:
        """(uncached input, output) price per token: what the hybrid router's ``SelfHostedRate`` takes."""
        return self.input_per_mtok / MILLION, self.output_per_mtok / MILLION


#: Rounding of the per-Mtok prices a GPU-hour card yields: 1e-6 of the currency per Mtok, half-even.
MTOK_PRICE_STEP = Decimal("1e-6")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_money(value: object, where: str, currency: str | None = None) -> tuple[Decimal, str | None]:
    """An amount with an optional currency suffix (``"2.50 USD"``, ``"2.50"``, ``2.5``) → (amount, code).

    A suffix that disagrees with ``currency`` raises ``InputError`` (amounts are never converted)."""
    code = None
    if isinstance(value, str) and len(value.split()) == 2:
        number, code = value.split()
        code = check_currency(code, where)
        value = number
    amount = to_decimal(value, where)
    if amount < 0:
        raise InputError(where, f"must not be negative, got {amount}")
    if code is not None and currency is not None and code != check_currency(currency, where):
        raise InputError(where, f"is in {code} but the rate card is in {currency}; amounts are never converted")
    return amount, code


@dataclass(frozen=True, slots=True)
class GpuRateCard:
    """Self-hosted cost from a GPU-hour price and measured throughput, as prices per million tokens.

    ``input_per_mtok = gpu_hour × gpus / (prefill_tok_s × 3600) × 1e6`` (the GPU-seconds one prompt token
    costs) and ``output_per_mtok`` the same with ``decode_tok_s`` (the replica's aggregate decode rate at its
    usual batch), each rounded half-even to ``MTOK_PRICE_STEP``; a cached prompt token costs
    ``cache_read_per_mtok`` (default 0: no prefill work), a cache write costs like uncached input.
    """

    gpu_hour: Decimal
    prefill_tok_s: Decimal
    decode_tok_s: Decimal
    gpus: int = 1
    currency: str = "USD"
    cache_read_per_mtok: Decimal = ZERO

    def __post_init__(self) -> None:
        for name in ("gpu_hour", "prefill_tok_s", "decode_tok_s", "cache_read_per_mtok"):
            value = to_decimal(getattr(self, name), name)
            if value < 0 or (name.endswith("tok_s") and value == 0):
                raise InputError(name, f"must be {'positive' if name.endswith('tok_s') else '>= 0'}, got {value}")
            object.__setattr__(self, name, value)
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise InputError("gpus", f"must be an integer >= 1, got {self.gpus!r}")
        object.__setattr__(self, "currency", check_currency(self.currency))

    def _per_mtok(self, tok_s: Decimal) -> Decimal:
        return (self.gpu_hour * self.gpus * MILLION / (tok_s * 3600)).quantize(MTOK_PRICE_STEP, ROUND_HALF_EVEN)

    @property
    def input_per_mtok(self) -> Decimal:
        return self._per_mtok(self.prefill_tok_s)

    @property
    def output_per_mtok(self) -> Decimal:
        return self._per_mtok(self.decode_tok_s)

    def per_token(self) -> tuple[Decimal, Decimal]:
        """(input, output) price per token: what the hybrid router's ``SelfHostedRate`` takes."""
        return self.input_per_mtok / MILLION, self.output_per_mtok / MILLION

    def cost_rate(self, backend_id: str, effective_from: datetime = _EPOCH) -> CostRate:
        """The ledger's rate card for ``backend_id`` (source ``self_hosted_amortized``)."""
        return CostRate(backend_id, effective_from, self.currency, input_per_mtok=self.input_per_mtok,
                        cache_read_per_mtok=self.cache_read_per_mtok, cache_write_5m_per_mtok=self.input_per_mtok,
                        cache_write_1h_per_mtok=self.input_per_mtok, output_per_mtok=self.output_per_mtok,
                        source="self_hosted_amortized", prefill_tok_s=self.prefill_tok_s)


def token_cost(rate: CostRate, *, input_uncached: int = 0, cache_read: int = 0, output: int = 0) -> Decimal:
    """What one request costs on ``rate`` (Decimal at the ledger's 1e-10 scale): the one function the
    router's hybrid decision, the simulator and the ledger share, so all three charge the same amount."""
    return fix(rate.cost(TokenBuckets(input_uncached=input_uncached, cache_read=cache_read, output=output)))


@dataclass(frozen=True, slots=True)
class PriceRule:
    """One ordered rule of a price book; ``None`` matchers are wildcards, ``model`` may be a glob."""

    name: str
    priority: int
    match_provider: str | None = None
    match_model: str | None = None
    match_backend: str | None = None
    match_route_kind: str | None = None
    markup_pct: Decimal | None = None
    surcharge_per_mtok: dict[str, Decimal] = field(default_factory=dict)
    fee_per_request: Decimal | None = None
    min_per_request: Decimal | None = None
    max_per_request: Decimal | None = None
    bill_failed_attempts: bool = False
    bill_zero_completion: bool = False
    price_rule_id: int | None = None
    #: a request whose client went away (a final ``cancelled`` attempt) is billed like an answer: the provider
    #: bills it; false absorbs it (shown under the ``cancelled`` cause)
    bill_cancelled: bool = True
    #: a hedge race's losing attempt (non-final ``cancelled``, ``error_type: hedge_lost``) is passed on to the app;
    #: false (the default) absorbs it, shown under the ``hedge`` cause
    bill_hedge_lost: bool = False

    def matches(self, e: UsageEvent) -> bool:
        return ((self.match_provider is None or self.match_provider == e.provider)
                and (self.match_model is None or fnmatchcase(e.served_model, self.match_model))
                and (self.match_backend is None or self.match_backend == e.backend_id)
                and (self.match_route_kind is None or self.match_route_kind == e.route_kind))

    def describe(self) -> str:
        """Human-readable terms, e.g. ``+20 % · +$0.50/Mtok input · $0.001/req``."""
        parts = []
        if self.markup_pct is not None:
            parts.append(f"+{(self.markup_pct * 100).normalize():f} %")
        for bucket, amount in self.surcharge_per_mtok.items():
            parts.append(f"+{amount.normalize():f}/Mtok {bucket}")
        if self.fee_per_request is not None:
            parts.append(f"{self.fee_per_request.normalize():f}/req")
        if self.min_per_request is not None:
            parts.append(f"min {self.min_per_request.normalize():f}")
        if self.max_per_request is not None:
            parts.append(f"max {self.max_per_request.normalize():f}")
        if not self.bill_cancelled:
            parts.append("cancelled requests absorbed")
        if self.bill_hedge_lost:
            parts.append("hedges billed")
        return f"{self.name}: " + (" · ".join(parts) if parts else "at cost")


@dataclass(frozen=True, slots=True)
class PriceBook:
    """A versioned set of ordered rules for one app (``app_id=None``: the default book)."""

    app_id: str | None
    version: int
    effective_from: datetime
    currency: str = "USD"
    rules: tuple[PriceRule, ...] = ()
    platform_fee_pct: Decimal = ZERO
    payment_fee_pct: Decimal = ZERO
    price_book_id: int | None = None

    def rule_for(self, e: UsageEvent) -> PriceRule | None:
        for rule in self.rules:  # kept sorted by priority
            if rule.matches(e):
                return rule
        return None


@dataclass(frozen=True, slots=True)
class Rating:
    """The money of one rated event (scale 1e-10)."""

    provider_cost: Decimal
    cost_source: str
    provider_cost_computed: Decimal | None
    markup_amount: Decimal
    surcharge_amount: Decimal
    fee_amount: Decimal
    billed_amount: Decimal
    absorbed_cost: Decimal
    currency: str
    cost_rate_id: int | None = None
    price_book_id: int | None = None
    price_book_version: int | None = None
    price_rule_id: int | None = None


def rate_event(e: UsageEvent, cost_rate: CostRate | None, book: PriceBook | None) -> Rating:
    """Rate one event against a rate card and a price book (either may be missing: cost 0 / billed at cost)."""
    target = book.currency if book is not None else e.currency
    computed = fix(cost_rate.cost(e.tokens)) if cost_rate is not None else None
    reported = e.provider_cost is not None or e.litellm_cost is not None
    if reported and e.currency != target:
        raise InputError("currency", f"the event's cost is in {e.currency} but app {e.app_id!r} is billed in "
                                     f"{target}; amounts are never converted")
    if cost_rate is not None and cost_rate.currency != target:
        if not reported:
            raise InputError("currency", f"the rate card of backend {e.backend_id!r} is in {cost_rate.currency} "
                                         f"but app {e.app_id!r} is billed in {target}; amounts are never converted")
        computed = None  # a figure in another currency is not kept beside the reported cost
    amortized = computed is not None and cost_rate is not None and cost_rate.source == "self_hosted_amortized"
    if e.status == "no_route":  # LiteLLM refused it before any upstream call: nothing to price, nothing missing
        cost, source = ZERO, NOT_CALLED
    elif e.provider_cost is not None:
        cost, source = fix(e.provider_cost), "provider_reported"
    elif amortized:  # our own GPU's cost beats the per-token price typed into model_list
        cost, source = computed, "self_hosted_amortized"
    elif e.litellm_cost is not None:
        cost, source = fix(e.litellm_cost), "litellm"
    elif computed is not None:
        cost, source = computed, cost_rate.source if cost_rate.source != "manual" else "rate_card"
    else:
        cost, source = ZERO, "unknown"
    rule = book.rule_for(e) if book is not None else None
    markup = surcharge = fee = ZERO
    if rule is not None:
        if rule.markup_pct is not None:
            markup = fix(cost * rule.markup_pct)
        if rule.surcharge_per_mtok:
            t = e.tokens
            total = sum((sum(getattr(t, b) for b in SURCHARGE_BUCKETS[k]) * amount
                         for k, amount in rule.surcharge_per_mtok.items()), ZERO)
            surcharge = fix(total / MILLION)
        if rule.fee_per_request is not None:
            fee = rule.fee_per_request
    billed = cost + markup + surcharge + fee
    if rule is not None:
        if rule.min_per_request is not None and billed < rule.min_per_request:
            billed = rule.min_per_request
        if rule.max_per_request is not None and billed > rule.max_per_request:
            billed = rule.max_per_request
    if e.is_final and e.status == "success":
        bill_it = True
    elif e.status == "cancelled" and e.is_final:  # the client went away; the provider still bills the call
        bill_it = rule is None or rule.bill_cancelled
    elif e.status == "cancelled" and e.error_type == HEDGE_LOST:  # our hedge's loser: absorbed unless passed on
        bill_it = rule is not None and rule.bill_hedge_lost
    elif e.status == "zero_completion":  # an empty answer, final or retried, bills only under this flag
        bill_it = rule is not None and rule.bill_zero_completion and (e.is_final or rule.bill_failed_attempts)
    else:  # a failed or superseded attempt
        bill_it = rule is not None and rule.bill_failed_attempts
    if not bill_it:
        billed = ZERO
    if billed == ZERO:
        markup = surcharge = fee = ZERO
    else:  # what the app pays beyond cost is split into markup/surcharge/fee; clamp differences land on markup
        markup = billed - cost - surcharge - fee
    absorbed = cost if billed == ZERO else ZERO
    return Rating(fix(cost), source, computed, fix(markup), surcharge, fix(fee), fix(billed), fix(absorbed),
                  target,
                  cost_rate.cost_rate_id if cost_rate is not None else None,
                  book.price_book_id if book is not None else None, book.version if book is not None else None,
                  rule.price_rule_id if rule is not None else None)
