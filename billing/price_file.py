"""Price files (YAML or TOML, kept in version control): backends, rate cards and per-app price books.

```yaml
currency: USD                        # default for everything below
cancel_billing: {bedrock: full}      # what a provider bills for a call its client left: relayed | full | none
backends:
  - id: vllm-a                       # backend_id as the router names it
    provider: self_hosted
    served_model: llama-3.1-8b
    route_kind: self_hosted          # marketplace | self_hosted | direct
    rates:                           # versioned rate cards, $ per 1M tokens
      - effective_from: 2026-01-01
        gpu_hour: "2.40 USD"         # self-hosted: price of one replica-hour (× gpus), see GpuRateCard
        prefill_tok_s: 15000         # input $/Mtok = gpu_hour × gpus / (prefill_tok_s × 3600) × 1e6
        decode_tok_s: 2500           # output $/Mtok likewise (both rounded half-even to 1e-6 per Mtok)
        cache_read_per_mtok: "0"     # (the older `tokens_per_s: N` prices every bucket alike)
    cancel_billing: relayed          # this backend's own (default: its provider's, see kvroute.billing.cancels)
price_books:
  - app: acme                        # omit for the default book
    version: 2
    effective_from: 2026-10-01
    platform_fee_pct: "5%"             # every *_pct field: "5%" or the fraction "0.05"; a bare 5 is refused
    rules:                           # first matching rule wins, in order
      - name: claude
        match: {provider: anthropic, model: "claude-*"}
        markup_pct: "0.20"
        surcharge_per_mtok: {input: "0.50", output: "1.00", cache_read: "0"}
        fee_per_request: "0.0005"
        min_per_request: "0.0001"
        bill_failed_attempts: false
        bill_zero_completion: false
        bill_cancelled: true         # a request its client left is billed like an answer (false: absorbed)
        bill_hedge_lost: false       # a hedge's losing attempt is absorbed (true: passed on)
```
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvroute.billing.cancels import check_cancel_billing
from kvroute.billing.events import ROUTE_KINDS
from kvroute.billing.money import MILLION, ZERO, check_currency, to_decimal
from kvroute.billing.pricing import SURCHARGE_BUCKETS, CostRate, GpuRateCard, PriceBook, PriceRule, parse_money
from kvroute.policies.errors import ConfigError, InputError

RATE_FIELDS = ("input_per_mtok", "cache_read_per_mtok", "cache_write_5m_per_mtok", "cache_write_1h_per_mtok",
               "output_per_mtok", "reasoning_per_mtok", "per_request")
#: Self-hosted rate-card fields: ``gpu_hour`` (price per replica-hour of ``gpus`` GPUs, optionally with its
#: currency: ``"2.50 USD"``) with ``prefill_tok_s`` + ``decode_tok_s`` (or the older single ``tokens_per_s``).
GPU_FIELDS = ("gpu_hour", "tokens_per_s", "prefill_tok_s", "decode_tok_s", "gpus")
RATE_SOURCES = ("manual", "provider_reported", "litellm_model_cost", "self_hosted_amortized")
RULE_FIELDS = {"name", "match", "markup_pct", "surcharge_per_mtok", "fee_per_request", "min_per_request",
               "max_per_request", "bill_failed_attempts", "bill_zero_completion", "bill_cancelled", "bill_hedge_lost"}


@dataclass(frozen=True)
class BackendSpec:
    backend_id: str
    provider: str
    served_model: str | None
    route_kind: str
    endpoint: str | None
    cancel_billing: str | None = None  # None: its provider's known mode (``kvroute.billing.cancels``)


@dataclass(frozen=True)
class PriceFile:
    """A parsed, validated price file."""

    backends: tuple[BackendSpec, ...]
    rates: tuple[CostRate, ...]
    books: tuple[PriceBook, ...]


def read_price_file(path: str | Path) -> PriceFile:
    """Read and validate a ``.yaml``/``.yml``/``.toml`` price file; ``ConfigError.key`` names the bad entry."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read price file: {exc.strerror}") from None
    try:
        if p.suffix.lower() == ".toml":
            data = tomllib.loads(raw.decode())
        else:
            import yaml
            data = yaml.safe_load(raw)
    except Exception as exc:
        raise ConfigError(str(p), f"not valid {'TOML' if p.suffix == '.toml' else 'YAML'}: {exc}") from None
    return parse_price_data(data or {})


def _dec(value: Any, key: str, *, allow_negative: bool = False) -> Decimal:
    try:
        amount = to_decimal(value, key)
    except InputError as exc:
        raise ConfigError(key, exc.message) from None
    if amount < 0 and not allow_negative:
        raise ConfigError(key, f"must not be negative, got {amount}")
    return amount


#: The largest markup a rule may carry (a fraction: 100 = +10 000 %); above it the value is surely a typo.
MAX_MARKUP = Decimal(100)


def _pct(value: Any, key: str, *, limit: Decimal, what: str) -> Decimal:
    """A ``*_pct`` field as a fraction: ``"20%"`` (a percent string) or ``0.20`` (a fraction below 1).

    A bare number of 1 or more is refused: ``markup_pct: 20`` means +20 % far more often than +2000 %, and a
    bare ``1`` is as likely 1 % as 100 %, so from 100 % up only the percent form is accepted."""
    if isinstance(value, str) and value.strip().endswith("%"):
        number = value.strip()[:-1].strip()
        amount = _dec(number, key) / 100
    else:
        amount = _dec(value, key)
        if amount >= 1:
            shown = value if isinstance(value, str) else repr(value)
            raise ConfigError(key, f"{shown} is ambiguous ({what}): write \"{amount.normalize():f}%\" for "
                                   f"{amount.normalize():f} percent or the fraction "
                                   f"{(amount / 100).normalize():f}; a bare number must be a fraction below 1")
    if amount > limit:
        raise ConfigError(key, f"{(amount * 100).normalize():f} % is above the limit of "
                               f"{(limit * 100).normalize():f} % ({what})")
    return amount


def _when(value: Any, key: str) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    if isinstance(value, str):
        try:
            return _when(datetime.fromisoformat(value.replace("Z", "+00:00")), key)
        except ValueError:
            pass
    raise ConfigError(key, f"expected a date (YYYY-MM-DD) or an RFC 3339 time, got {value!r}")


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {type(value).__name__}")
    return value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}")
    return value


def parse_price_data(data: Any) -> PriceFile:
    """Validate the parsed document (see the module docstring)."""
    root = _mapping(data, "(price file)")
    unknown = set(root) - {"currency", "cancel_billing", "backends", "price_books"}
    if unknown:
        raise ConfigError(sorted(unknown)[0],
                          "unknown top-level key (known: currency, cancel_billing, backends, price_books)")
    try:
        currency = check_currency(root.get("currency", "USD"))
    except InputError as exc:
        raise ConfigError("currency", exc.message) from None
    by_provider = {str(p): _cancel_mode(m, f"cancel_billing.{p}")
                   for p, m in _mapping(root.get("cancel_billing") or {}, "cancel_billing").items()}
    backends, rates = [], []
    for i, item in enumerate(_list(root.get("backends"), "backends")):
        backend, backend_rates = _backend(_mapping(item, f"backends[{i}]"), f"backends[{i}]", currency)
        if backend.cancel_billing is None and backend.provider in by_provider:
            backend = replace(backend, cancel_billing=by_provider[backend.provider])
        backends.append(backend)
        rates.extend(backend_rates)
    if len({b.backend_id for b in backends}) != len(backends):
        raise ConfigError("backends", "backend ids must be unique")
    books = [_book(_mapping(item, f"price_books[{i}]"), f"price_books[{i}]", currency)
             for i, item in enumerate(_list(root.get("price_books"), "price_books"))]
    seen = set()
    for book in books:
        key = (book.app_id or "*", book.version)
        if key in seen:
            raise ConfigError("price_books", f"app {key[0]!r} version {key[1]} appears twice")
        seen.add(key)
    return PriceFile(tuple(backends), tuple(rates), tuple(books))


def _backend(item: Mapping[str, Any], key: str, currency: str) -> tuple[BackendSpec, list[CostRate]]:
    unknown = set(item) - {"id", "provider", "served_model", "route_kind", "endpoint", "cancel_billing", "rates"}
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
    backend_id = item.get("id")
    if not isinstance(backend_id, str) or not backend_id:
        raise ConfigError(f"{key}.id", "is required (a non-empty string)")
    key = f"backends[{backend_id}]"
    provider = item.get("provider")
    if not isinstance(provider, str) or not provider:
        raise ConfigError(f"{key}.provider", "is required (a non-empty string)")
    rates = []
    for j, rate in enumerate(_list(item.get("rates"), f"{key}.rates")):
        rates.append(_rate(_mapping(rate, f"{key}.rates[{j}]"), f"{key}.rates[{j}]", backend_id, currency))
    amortized = any(r.source == "self_hosted_amortized" for r in rates)  # a GPU-hour card: a replica of ours
    route_kind = item.get("route_kind", "self_hosted" if amortized else "direct")
    if route_kind not in ROUTE_KINDS:
        raise ConfigError(f"{key}.route_kind", f"must be one of {', '.join(ROUTE_KINDS)}, got {route_kind!r}")
    if len({r.effective_from for r in rates}) != len(rates):
        raise ConfigError(f"{key}.rates", "two rate cards start at the same time")
    cancel = item.get("cancel_billing")
    return BackendSpec(backend_id, provider, item.get("served_model"), route_kind, item.get("endpoint"),
                       None if cancel is None else _cancel_mode(cancel, f"{key}.cancel_billing")), rates


def _cancel_mode(value: Any, key: str) -> str:
    try:
        return check_cancel_billing(value, key)
    except InputError as exc:
        raise ConfigError(key, exc.message) from None


def _rate(item: Mapping[str, Any], key: str, backend_id: str, currency: str) -> CostRate:
    unknown = set(item) - {*RATE_FIELDS, "effective_from", "currency", "source", *GPU_FIELDS}
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown rate field")
    if "effective_from" not in item:
        raise ConfigError(f"{key}.effective_from", "is required")
    values = {f: _dec(item[f], f"{key}.{f}") for f in RATE_FIELDS if item.get(f) is not None}
    source = item.get("source", "manual")
    try:
        cur = check_currency(item.get("currency", currency))
    except InputError as exc:
        raise ConfigError(f"{key}.currency", exc.message) from None
    prefill_tok_s = None
    if any(f in item for f in GPU_FIELDS):
        for f, v in _gpu_prices(item, key, cur).items():
            values.setdefault(f, v)
        source = item.get("source", "self_hosted_amortized")
        prefill_tok_s = _dec(item.get("prefill_tok_s", item.get("tokens_per_s")), f"{key}.prefill_tok_s")
    if source not in RATE_SOURCES:
        raise ConfigError(f"{key}.source", f"must be one of {', '.join(RATE_SOURCES)}")
    return CostRate(backend_id, _when(item["effective_from"], f"{key}.effective_from"), cur,
                    values.get("input_per_mtok", ZERO), values.get("cache_read_per_mtok", ZERO),
                    values.get("cache_write_5m_per_mtok", ZERO), values.get("cache_write_1h_per_mtok", ZERO),
                    values.get("output_per_mtok", ZERO), values.get("reasoning_per_mtok"),
                    values.get("per_request", ZERO), source, prefill_tok_s=prefill_tok_s)


def _gpu_prices(item: Mapping[str, Any], key: str, currency: str) -> dict[str, Decimal]:
    """Per-Mtok prices of a self-hosted card: ``gpu_hour`` with ``prefill_tok_s``/``decode_tok_s`` (a
    ``GpuRateCard``), or the older single ``tokens_per_s`` for every bucket (not rounded)."""
    if "gpu_hour" not in item:
        raise ConfigError(f"{key}.gpu_hour", "is required with tokens_per_s / prefill_tok_s / decode_tok_s")
    try:
        gpu_hour, _ = parse_money(item["gpu_hour"], f"{key}.gpu_hour", currency)
    except InputError as exc:
        raise ConfigError(exc.where, exc.message) from None
    if "tokens_per_s" in item:
        if "prefill_tok_s" in item or "decode_tok_s" in item or "gpus" in item:
            raise ConfigError(f"{key}.tokens_per_s", "give either tokens_per_s or prefill_tok_s + decode_tok_s")
        tps = _dec(item["tokens_per_s"], f"{key}.tokens_per_s")
        if tps == 0:
            raise ConfigError(f"{key}.tokens_per_s", "must be positive")
        per_mtok = gpu_hour / (tps * 3600) * MILLION
        return {f: per_mtok for f in ("input_per_mtok", "output_per_mtok", "cache_write_5m_per_mtok",
                                      "cache_write_1h_per_mtok")}
    for f in ("prefill_tok_s", "decode_tok_s"):
        if f not in item:
            raise ConfigError(f"{key}.{f}", "is required with gpu_hour (measured tokens per second per replica)")
    gpus = item.get("gpus", 1)
    try:
        card = GpuRateCard(gpu_hour, _dec(item["prefill_tok_s"], f"{key}.prefill_tok_s"),
                           _dec(item["decode_tok_s"], f"{key}.decode_tok_s"), gpus, currency,
                           _dec(item.get("cache_read_per_mtok", 0), f"{key}.cache_read_per_mtok"))
    except InputError as exc:
        raise ConfigError(f"{key}.{exc.where}", exc.message) from None
    rate = card.cost_rate("")
    return {"input_per_mtok": rate.input_per_mtok, "output_per_mtok": rate.output_per_mtok,
            "cache_write_5m_per_mtok": rate.cache_write_5m_per_mtok,
            "cache_write_1h_per_mtok": rate.cache_write_1h_per_mtok}


def _book(item: Mapping[str, Any], key: str, currency: str) -> PriceBook:
    unknown = set(item) - {"app", "version", "effective_from", "currency", "platform_fee_pct", "payment_fee_pct",
                           "rules"}
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
    app = item.get("app")
    if app is not None and (not isinstance(app, str) or not app or app == "*"):
        raise ConfigError(f"{key}.app", "must be a non-empty app id (omit it for the default book)")
    version = item.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{key}.version", f"must be a positive integer, got {version!r}")
    key = f"price_books[{app or 'default'} v{version}]"
    if "effective_from" not in item:
        raise ConfigError(f"{key}.effective_from", "is required")
    try:
        cur = check_currency(item.get("currency", currency))
    except InputError as exc:
        raise ConfigError(f"{key}.currency", exc.message) from None
    rules = []
    for j, rule in enumerate(_list(item.get("rules"), f"{key}.rules")):
        rules.append(_rule(_mapping(rule, f"{key}.rules[{j}]"), f"{key}.rules[{j}]", j))
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}.rules", "rule names must be unique within a book")
    fees = {f: _pct(item.get(f, 0), f"{key}.{f}", limit=Decimal("0.99"), what="a share of billed revenue")
            for f in ("platform_fee_pct", "payment_fee_pct")}
    return PriceBook(app, version, _when(item["effective_from"], f"{key}.effective_from"), cur, tuple(rules),
                     fees["platform_fee_pct"], fees["payment_fee_pct"])


def _rule(item: Mapping[str, Any], key: str, priority: int) -> PriceRule:
    name = item.get("name", f"rule{priority}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.name", "must be a non-empty string")
    key = f"{key.rsplit('.', 1)[0]}.rules[{name}]"
    unknown = set(item) - RULE_FIELDS
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}",
                          f"unknown rule field (known: {', '.join(sorted(RULE_FIELDS))})")
    match = dict(_mapping(item.get("match", {}), f"{key}.match"))
    bad = set(match) - {"provider", "model", "backend", "route_kind"}
    if bad:
        raise ConfigError(f"{key}.match.{sorted(bad)[0]}",
                          "unknown matcher (known: provider, model, backend, route_kind)")
    for m, v in match.items():
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{key}.match.{m}", "must be a non-empty string")
    if match.get("route_kind") not in (None, *ROUTE_KINDS):
        raise ConfigError(f"{key}.match.route_kind", f"must be one of {', '.join(ROUTE_KINDS)}")
    surcharge = {}
    for bucket, amount in _mapping(item.get("surcharge_per_mtok", {}), f"{key}.surcharge_per_mtok").items():
        if bucket not in SURCHARGE_BUCKETS:
            raise ConfigError(f"{key}.surcharge_per_mtok.{bucket}",
                              f"unknown bucket (known: {', '.join(SURCHARGE_BUCKETS)})")
        surcharge[bucket] = _dec(amount, f"{key}.surcharge_per_mtok.{bucket}")
    opt = {f: (None if item.get(f) is None else _dec(item[f], f"{key}.{f}"))
           for f in ("fee_per_request", "min_per_request", "max_per_request")}
    opt["markup_pct"] = None if item.get("markup_pct") is None else _pct(
        item["markup_pct"], f"{key}.markup_pct", limit=MAX_MARKUP, what="a markup on the provider cost")
    if opt["min_per_request"] is not None and opt["max_per_request"] is not None \
            and opt["min_per_request"] > opt["max_per_request"]:
        raise ConfigError(f"{key}.min_per_request", "is above max_per_request")
    return PriceRule(name, priority, match.get("provider"), match.get("model"), match.get("backend"),
                     match.get("route_kind"), opt["markup_pct"], surcharge, opt["fee_per_request"],
                     opt["min_per_request"], opt["max_per_request"],
                     _flag(item.get("bill_failed_attempts", False), f"{key}.bill_failed_attempts"),
                     _flag(item.get("bill_zero_completion", False), f"{key}.bill_zero_completion"),
                     bill_cancelled=_flag(item.get("bill_cancelled", True), f"{key}.bill_cancelled"),
                     bill_hedge_lost=_flag(item.get("bill_hedge_lost", False), f"{key}.bill_hedge_lost"))


def book_hash(book: PriceBook) -> str:
    """A content hash of a book (without database ids): loading the same version twice must match it."""
    plain = _jsonable(replace(book, price_book_id=None,
                              rules=tuple(replace(r, price_rule_id=None) for r in book.rules)))
    for rule in plain["rules"]:  # a book stored before these flags existed hashes as it did: defaults left out
        for flag, default in (("bill_cancelled", True), ("bill_hedge_lost", False)):
            if rule.get(flag) is default:
                del rule[flag]
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    from dataclasses import fields, is_dataclass
    if is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, Decimal):
        return str(value.normalize())
    if isinstance(value, datetime):
        return value.isoformat()
    return value
