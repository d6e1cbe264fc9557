"""One attempt as observed (``CallFacts``) and the usage event the ledger books for it (``event_from_facts``).

Whoever observed the attempt -- kvroute's own attempt record or LiteLLM's callback payload
(``litellm_events.facts_from_callback``) -- states the facts; every billing rule lives in ``event_from_facts``:

- status: a success with no output and no finish reason (or ``error``) is ``zero_completion``;
- provider cost: the provider's reported cost (``reported_cost``, else ``usage.cost``); a reported cost equal to
  LiteLLM's own (LiteLLM's stamp of its bill on a stream), or on a ``self_hosted`` row, counts as LiteLLM's and
  leaves ``raw_usage``; LiteLLM's cost loses LiteLLM's own margin; a LiteLLM cost of 0 for tokens is "unpriced";
- column limits: every string a client or provider controls (tags too) is fitted to its ledger column (``fit``): longer
  values keep their first characters and end in ``~`` plus 12 hex digits of their sha256, so distinct long values
  stay distinct and the event is valid on SQLite and PostgreSQL alike; integers are clamped to the column's range.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kvroute.billing.events import ROUTE_KINDS, STATUSES, UsageEvent, fits_as_is
from kvroute.billing.money import to_decimal
from kvroute.billing.usage import PlainUsage, as_mapping, normalize_plain, normalize_usage
from kvroute.policies.errors import InputError

INT32_MAX = 2**31 - 1

# ledger column widths (billing.models.UsageEventRow); kept here so building an event never imports SQLAlchemy
LIMITS = {"request_id": 200, "app_id": 200, "end_user": 200, "api_key_hash": 128, "requested_model": 200,
          "served_model": 200, "provider": 100, "backend_id": 200, "error_type": 100, "attempt_key": 200,
          "session_id": 200}
TAG_LIMIT, MAX_TAGS = 100, 20  # ``events.TAG_LIMIT``/``MAX_TAGS``: a tag's characters, tags per event


@dataclass(frozen=True, slots=True)
class CallFacts:
    """One upstream attempt (or router-level hop, or a request's final outcome) as observed, before any billing
    rule. Strings are taken as observed (``event_from_facts`` fits them); amounts are non-negative decimals."""

    request_id: str
    app_id: str
    served_model: str
    requested_model: str | None = None  # None: the served model
    backend_id: str | None = None  # None: the served model
    provider: str | None = None  # None: ``unknown``
    route_kind: str | None = None  # anything but one of ``ROUTE_KINDS``: ``direct``
    outcome: str = "success"  # ``success``, a ledger status, or ``config_failure`` (our side: never billed)
    final: bool | None = None  # None: final for a success only
    attempt: int | None = None  # None: attempt 0, told apart by ``attempt_key``
    attempt_key: str | None = None
    usage: Mapping[str, Any] | None = None  # the provider's usage (None or empty: the counts); ``as_mapping``'s
    # result is read as it is, any other mapping is made plain once
    usage_provider: str | None = None  # the LiteLLM provider whose usage shape ``usage`` has
    prompt_tokens: Any = 0  # counts of an attempt without usage
    completion_tokens: Any = 0
    reported_cost: Any = None  # the cost the response's own usage reports
    litellm_cost: Decimal | None = None  # LiteLLM's price of the attempt, margin included
    litellm_margin: Decimal | None = None  # LiteLLM's own margin in ``litellm_cost``
    finish_reason: Any = None
    http_status: int | None = None
    error_type: str | None = None
    streamed: bool = False
    sticky_hit: bool = False
    fallback_depth: Any = None
    start: datetime | float | None = None  # None: now
    end: datetime | float | None = None
    first_token: datetime | float | None = None
    end_user: str | None = None
    api_key_hash: str | None = None
    session_id: str | None = None  # the session the client named (header or metadata)
    tags: tuple[str, ...] = ()  # the request's metadata tags


def fit(value: Any, limit: int) -> str:
    """``value`` as a string of at most ``limit`` characters (long ones: a prefix, ``~`` and a 12-hex sha256)."""
    if fits_as_is(value, limit) and value:
        return value  # the common case: nothing to replace or shorten
    raw = value if isinstance(value, str) else str(value)
    # PostgreSQL text holds neither NUL nor lone surrogates: replace them (SQLite and PostgreSQL store the same)
    text = raw.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if text and len(text) <= limit:
        return text
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return text[:limit - 13] + "~" + digest


def fit_opt(value: Any, key: str) -> str | None:
    """``value`` fitted to the column ``key`` (None for None or an empty string)."""
    if value is None or value == "":
        return None
    return fit(value, LIMITS[key])


def int32(value: Any) -> int | None:
    """A non-negative integer clamped to the column's range (None for anything else)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return min(value, INT32_MAX)


def money(value: Any) -> Decimal | None:
    """A non-negative amount as an exact decimal (None for anything else)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        amount = to_decimal(value)
    except InputError:
        return None
    return amount if amount >= 0 else None


def moment(value: Any) -> datetime | None:
    """A datetime (naive: taken as local time) or a POSIX timestamp as an aware datetime (None otherwise)."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.astimezone(UTC)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            return None
    return None


def as_dict(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def first_given(*values: Any) -> Any:
    """The first value that is neither None nor an empty string (None when there is none)."""
    for v in values:
        if v not in (None, ""):
            return v
    return None


def event_from_facts(f: CallFacts) -> UsageEvent:
    """The usage event of one attempt (the rules in the module docstring); ``InputError`` for usage that
    contradicts itself, ``ValueError`` for an unknown ``outcome``."""
    served = f.served_model
    backend = str(first_given(f.backend_id, served))
    kind = f.route_kind if f.route_kind in ROUTE_KINDS else "direct"
    raw_usage: Mapping[str, Any]
    if f.usage:
        # made plain once: the producers' ``as_mapping`` result as it is, any other mapping (one a caller built,
        # nested pydantic details and all) converted here, so its tokens and its archived copy read the same
        raw_usage = f.usage if type(f.usage) is PlainUsage else as_mapping(f.usage)
        tokens = normalize_plain(raw_usage, f.usage_provider)
    else:
        raw_usage = {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens}
        tokens = normalize_usage(raw_usage)
    if f.outcome == "success":
        status = "success"
        if tokens.output == 0 and f.finish_reason in (None, "", "error"):
            status = "zero_completion"
    elif f.outcome in STATUSES:
        status = str(f.outcome)
    elif f.outcome == "config_failure":  # kvroute.policies.health.Outcome: our side failed; never billed
        status = "provider_failure"
    else:
        raise ValueError(f"outcome must be 'success', 'failure' or one of {STATUSES}, got {f.outcome!r}")
    is_final = f.final if f.final is not None else f.outcome == "success"
    start = moment(f.start) or datetime.now(UTC)
    end = moment(f.end)
    first_token = moment(f.first_token)
    ttft = int((first_token - start).total_seconds() * 1000) if first_token and first_token >= start else None
    duration = int((end - start).total_seconds() * 1000) if end and end >= start else None
    attempt_no = int32(f.attempt)
    if attempt_no is None:
        attempt_no = 0
    reported = money(f.reported_cost)
    if reported is None:
        reported = money(raw_usage.get("cost"))
    litellm_cost = f.litellm_cost
    if reported is not None and (reported == litellm_cost or kind == "self_hosted"):
        # LiteLLM stamps its own bill on a streamed usage.cost, and a replica reports no cost of its own: either
        # way the figure is LiteLLM's (the model_list price), not a provider's report
        litellm_cost = litellm_cost or reported  # a stream's hidden cost may still be 0
        reported = None
        if "cost" in raw_usage:
            # not the provider's usage: kept out of raw_usage, so no later reader (the drainer's validation,
            # a re-ingest) takes LiteLLM's figure for a provider report
            raw_usage = {k: v for k, v in raw_usage.items() if k != "cost"}
    if litellm_cost is not None and f.litellm_margin:
        litellm_cost = max(litellm_cost - f.litellm_margin, Decimal(0))
    if litellm_cost == 0 and tokens.prompt_total + tokens.output > 0:
        litellm_cost = None  # LiteLLM prices unknown models at 0.0: treat as unpriced, let the rate card decide
    return UsageEvent(
        request_id=fit(f.request_id, LIMITS["request_id"]), app_id=fit(f.app_id, LIMITS["app_id"]),
        occurred_at=start, served_model=fit(served, LIMITS["served_model"]),
        provider=fit(first_given(f.provider, "unknown"), LIMITS["provider"]),
        backend_id=fit(backend, LIMITS["backend_id"]), tokens=tokens, attempt=attempt_no, is_final=is_final,
        status=status, requested_model=fit(first_given(f.requested_model, served), LIMITS["requested_model"]),
        route_kind=kind, end_user=fit_opt(f.end_user, "end_user"), api_key_hash=fit_opt(f.api_key_hash, "api_key_hash"),
        http_status=f.http_status, error_type=fit_opt(f.error_type, "error_type"), streamed=bool(f.streamed),
        sticky_hit=f.sticky_hit, fallback_depth=int32(f.fallback_depth) or 0,
        ttft_ms=int32(ttft), duration_ms=int32(duration), provider_cost=reported, litellm_cost=litellm_cost,
        raw_usage=dict(raw_usage), attempt_key=fit_opt(f.attempt_key, "attempt_key"),
        session_id=fit_opt(f.session_id, "session_id"), tags=fit_tags(f.tags),
    )


def fit_tags(tags: Any) -> tuple[str, ...]:
    """At most ``MAX_TAGS`` of ``tags`` (the first in sorted order), each a non-empty string fitted to ``TAG_LIMIT``."""
    if not tags:
        return ()
    fitted = sorted({fit(t, TAG_LIMIT) for t in tags if t not in (None, "")})
    return tuple(fitted[:MAX_TAGS])
