"""``UsageEvent``: one upstream attempt, unrated, with a deterministic id; and its JSON form.

JSON schema (one object per line in ``kvroute billing ingest`` files, and in the spool):

=====================  ========  ==========================================================================
field                  required  meaning
=====================  ========  ==========================================================================
request_id             yes       the request (LiteLLM call id); attempts of one request share it
attempt                no        0-based attempt number (default 0)
final                  no        this attempt answered the request (default true); only final attempts bill
app_id                 yes       the app the request is billed to
occurred_at            yes       RFC 3339 time with a UTC offset, e.g. ``2026-10-03T12:00:00Z``
served_model           yes       the model that ran; ``requested_model`` (default: served_model)
provider, backend_id   yes       who served it; ``route_kind``: ``marketplace|self_hosted|direct`` (default direct)
status                 no        ``success|provider_failure|capacity|client_error|cancelled|zero_completion``
usage                  yes*      buckets ``input_uncached, cache_read, cache_write_5m, cache_write_1h, output,
                                 reasoning`` -- or ``raw_usage``: a provider usage object, normalised on ingest
                                 (a file line with token counts in both is refused; a ``raw_usage`` of just
                                 ``cost`` may sit beside ``usage``; kvroute's own journal lines carry
                                 ``raw_usage`` beside ``usage`` as the archived copy the buckets came from)
provider_cost          no        cost the provider reported (decimal string or JSON number, read exactly); absent:
                                 ``raw_usage.cost`` (OpenRouter's ``usage.cost``) when given
litellm_cost           no        LiteLLM's cost for the attempt *before* LiteLLM's own margin
currency               no        ISO-4217, default ``USD``
end_user, api_key_hash no        attribution details (never prompt text)
session_id             no        the client's session (``x-session-id`` or request metadata), at most 200 characters
tags                   no        the request's tags (strings of at most 100 characters, at most 20, sorted unique)
http_status, error_type, streamed, sticky_hit, fallback_depth, ttft_ms, duration_ms, router_attempts: optional
event_id               no        if given, must equal the deterministic id (sha256 of app|request|attempt)
=====================  ========  ==========================================================================

Limits (``FIELD_LIMITS``, enforced when a ``UsageEvent`` is built, so SQLite and PostgreSQL accept exactly the
same events): strings fit their columns (e.g. ``request_id`` at most 200 characters) and hold no NUL character or
lone surrogate; integers fit 32-bit columns (``duration_ms`` below 2**31); token counts are at most 10**12 and
amounts at most ``MAX_AMOUNT`` (10**8) per event.
When ``provider_cost`` is absent, a ``cost`` carried by ``raw_usage`` (OpenRouter's ``usage.cost``) is the
provider cost; JSON numbers are read exactly from their literal (``kvroute billing ingest`` parses floats as
``Decimal``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import msgspec

from kvroute.billing.money import MAX_AMOUNT, check_currency, to_decimal
from kvroute.billing.usage import TokenBuckets, normalize_usage, reported_cost
from kvroute.policies.errors import InputError

#: Column limits of every stored field: a maximum string length, or the range an integer must lie in.
INT32 = range(0, 2**31)
FIELD_LIMITS: dict[str, int | range] = {
    "request_id": 200, "app_id": 200, "served_model": 200, "requested_model": 200, "provider": 100,
    "backend_id": 200, "end_user": 200, "api_key_hash": 128, "error_type": 100, "attempt_key": 1000,
    "session_id": 200,
    "attempt": INT32, "http_status": range(0, 1000), "fallback_depth": INT32, "ttft_ms": INT32, "duration_ms": INT32,
}

STATUSES = ("success", "provider_failure", "capacity", "client_error", "cancelled", "zero_completion", "no_route")
ROUTE_KINDS = ("marketplace", "self_hosted", "direct")
#: The keys of a ``raw_usage`` that only carries the provider's cost (beside ``usage`` buckets: no ambiguity).
COST_ONLY = frozenset({"cost", "cost_details"})
#: Tags of one event: at most ``MAX_TAGS``, each at most ``TAG_LIMIT`` characters (the ``usage_event_tag`` column).
MAX_TAGS = 20
TAG_LIMIT = 100


def event_id_for(app_id: str, request_id: str, attempt: int | str) -> str:
    """Deterministic ledger event id: the first 32 hex digits of sha256(app|request|attempt).

    Three ids, three things: the *ledger request id* (``request_id``) is assigned by kvroute per client
    request (``kvroute.plugin.adapter.billing_feed``), never taken from the client; the *attempt* is kvroute's
    own counter (or an ``attempt_key`` such as ``outcome`` for the request's final outcome row); the *event id* derives
    from both. A LiteLLM trace id, ``x-session-id`` or ``litellm_call_id`` (all client-settable) is never part of it.
    """
    return hashlib.sha256(f"{app_id}|{request_id}|{attempt}".encode()).hexdigest()[:32]


_LINE_ENCODER = msgspec.json.Encoder(order="sorted")


def period_of(moment: datetime) -> str:
    """The billing period (``YYYY-MM``, UTC) a moment falls in."""
    utc = moment.astimezone(UTC)
    return f"{utc.year:04d}-{utc.month:02d}"


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One upstream attempt as metered (raw quantities and any reported cost); rating happens in the ledger."""

    request_id: str
    app_id: str
    occurred_at: datetime
    served_model: str
    provider: str
    backend_id: str
    tokens: TokenBuckets
    attempt: int = 0
    is_final: bool = True
    status: str = "success"
    requested_model: str | None = None
    route_kind: str = "direct"
    end_user: str | None = None
    api_key_hash: str | None = None
    http_status: int | None = None
    error_type: str | None = None
    streamed: bool = False
    sticky_hit: bool = False
    fallback_depth: int = 0
    ttft_ms: int | None = None
    duration_ms: int | None = None
    provider_cost: Decimal | None = None
    litellm_cost: Decimal | None = None
    currency: str = "USD"
    raw_usage: dict[str, Any] | None = None
    router_attempts: list[Any] | None = None
    attempt_key: str | None = None
    session_id: str | None = None
    tags: tuple[str, ...] = ()
    event_id: str = field(default="")

    def __post_init__(self) -> None:
        if self.occurred_at.tzinfo is None:
            raise InputError("occurred_at", "must carry a UTC offset")
        if self.status not in STATUSES:
            raise InputError("status", f"must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.route_kind not in ROUTE_KINDS:
            raise InputError("route_kind", f"must be one of {', '.join(ROUTE_KINDS)}, got {self.route_kind!r}")
        for name in ("request_id", "app_id", "served_model", "provider", "backend_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InputError(name, "must be a non-empty string")
        if not self.requested_model:
            object.__setattr__(self, "requested_model", self.served_model)
        if self.attempt_key == "":
            object.__setattr__(self, "attempt_key", None)
        if self.session_id == "":
            object.__setattr__(self, "session_id", None)
        if self.tags and (not isinstance(self.tags, tuple) or list(self.tags) != sorted(set(self.tags))):
            object.__setattr__(self, "tags", tuple(sorted(set(self.tags))))
        check_limits(self)
        expected = event_id_for(self.app_id, self.request_id,
                                self.attempt if self.attempt_key is None else self.attempt_key)
        if not self.event_id:
            object.__setattr__(self, "event_id", expected)
        elif self.event_id != expected:
            raise InputError("event_id", f"does not match the deterministic id {expected} of app|request|attempt")

    @property
    def period(self) -> str:
        return period_of(self.occurred_at)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (money as decimal strings)."""
        out: dict[str, Any] = {
            "event_id": self.event_id, "request_id": self.request_id, "attempt": self.attempt,
            "final": self.is_final, "app_id": self.app_id,
            "occurred_at": self.occurred_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
            "requested_model": self.requested_model, "served_model": self.served_model,
            "provider": self.provider, "backend_id": self.backend_id, "route_kind": self.route_kind,
            "status": self.status, "usage": self.tokens.as_dict(), "currency": self.currency,
            "streamed": self.streamed, "sticky_hit": self.sticky_hit, "fallback_depth": self.fallback_depth,
        }
        for name in ("end_user", "api_key_hash", "http_status", "error_type", "ttft_ms", "duration_ms",
                     "attempt_key", "session_id"):
            value = getattr(self, name)
            if value is not None and value != "":  # replay reads "" as invalid: absent and empty mean the same
                out[name] = value
        if self.tags:
            out["tags"] = list(self.tags)
        for name in ("raw_usage", "router_attempts"):  # archive copies: JSON-safe (Decimal literals as numbers)
            value = getattr(self, name)
            if value is not None:
                out[name] = json_safe(value)
        for name in ("provider_cost", "litellm_cost"):
            value = getattr(self, name)
            if value is not None:
                out[name] = str(value)
        return out

    def to_line(self) -> str:
        """The JSON form as one compact line with sorted keys."""
        return self.to_bytes().decode()

    def to_bytes(self) -> bytes:
        """``to_line`` encoded (msgspec: ~10x faster than ``json.dumps`` on the request path); values msgspec
        cannot encode (a lone surrogate in a client string) go through ``json.dumps``, which escapes them."""
        data = self.to_json()
        try:
            return _LINE_ENCODER.encode(data)
        except (TypeError, ValueError, UnicodeEncodeError):
            return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


_TEXT_LIMITS = tuple((n, limit) for n, limit in FIELD_LIMITS.items() if isinstance(limit, int))
_INT_LIMITS = tuple((n, limit) for n, limit in FIELD_LIMITS.items() if isinstance(limit, range))


def fits_as_is(value: Any, limit: int) -> bool:
    """A string both databases store unchanged within ``limit`` characters (ASCII, no NUL): the common case,
    checked cheaply on the request path."""
    return type(value) is str and len(value) <= limit and value.isascii() and "\x00" not in value


def check_limits(e: UsageEvent) -> None:
    """Raise ``InputError`` naming the first field of ``e`` that does not fit its ``FIELD_LIMITS`` entry."""
    for name, limit in _TEXT_LIMITS:
        value = getattr(e, name)
        if value is None or fits_as_is(value, limit):
            continue
        if not isinstance(value, str):
            raise InputError(name, f"must be a string, got {type(value).__name__}")
        if len(value) > limit:
            raise InputError(name, f"is {len(value)} characters long; at most {limit} are stored")
        check_text(value, name)
    for name, bounds in _INT_LIMITS:
        value = getattr(e, name)
        if value is None or (type(value) is int and bounds.start <= value < bounds.stop):
            continue
        raise InputError(name, f"must be an integer in [{bounds.start}, {bounds.stop - 1}], got {value!r}")
    if e.tags:
        check_tags(e.tags)
    if not (type(e.currency) is str and len(e.currency) == 3 and e.currency.isascii() and e.currency.isalpha()):
        check_currency(e.currency)
    for name in ("provider_cost", "litellm_cost"):
        amount = getattr(e, name)
        if amount is not None and not (isinstance(amount, Decimal) and amount.is_finite() and amount >= 0
                                       and amount <= MAX_AMOUNT):
            raise InputError(name, f"must be a decimal amount in [0, {MAX_AMOUNT}], got {amount!r}")


def check_tags(tags: Any) -> None:
    """Raise ``InputError`` (field ``tags``) unless ``tags`` are at most ``MAX_TAGS`` non-empty strings that fit."""
    if len(tags) > MAX_TAGS:
        raise InputError("tags", f"{len(tags)} tags; at most {MAX_TAGS} are stored")
    for tag in tags:
        if not isinstance(tag, str) or not tag:
            raise InputError("tags", f"must be non-empty strings, got {tag!r}")
        if len(tag) > TAG_LIMIT:
            raise InputError("tags", f"a tag is {len(tag)} characters long; at most {TAG_LIMIT} are stored")
        check_text(tag, "tags")


def fit_text(name: str, value: str | None) -> str | None:
    """``value`` made to fit ``FIELD_LIMITS[name]`` (for the request path, where refusing would lose the event):
    NUL characters and lone surrogates replaced; too long, cut with a hash suffix so distinct values stay distinct."""
    if value is None:
        return None
    limit = FIELD_LIMITS[name]
    assert isinstance(limit, int), name
    text = json_safe(str(value))
    if len(text) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        text = f"{text[:limit - 17]}~{digest}"
    return text


def check_text(value: str, where: str) -> None:
    """Strings both databases store alike: no NUL character (PostgreSQL refuses it), valid UTF-8."""
    if "\x00" in value:
        raise InputError(where, "must not contain a NUL character")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InputError(where, "is not valid Unicode (lone surrogate)") from None


_KNOWN = {"event_id", "request_id", "attempt", "final", "app_id", "occurred_at", "requested_model", "served_model",
          "provider", "backend_id", "route_kind", "status", "usage", "raw_usage", "usage_provider", "currency",
          "streamed", "sticky_hit", "fallback_depth", "end_user", "api_key_hash", "http_status", "error_type",
          "ttft_ms", "duration_ms", "router_attempts", "provider_cost", "litellm_cost", "attempt_key", "session_id",
          "tags"}


def _str(data: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            raise InputError(key, "is required")
        return None
    if not isinstance(value, str) or not value:
        raise InputError(key, f"must be a non-empty string, got {value!r}")
    return value


def _optint(data: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(key, f"must be a non-negative integer, got {value!r}")
    return value


def _bool(data: Mapping[str, Any], key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise InputError(key, f"must be true or false, got {value!r}")
    return value


def parse_time(value: object, key: str = "occurred_at") -> datetime:
    """Parse an RFC 3339 timestamp with an offset into an aware UTC datetime."""
    if not isinstance(value, str):
        raise InputError(key, f"must be an RFC 3339 string, got {value!r}")
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InputError(key, f"not an RFC 3339 time: {value!r}") from None
    if moment.tzinfo is None:
        raise InputError(key, f"needs a UTC offset (e.g. 'Z'): {value!r}")
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise InputError(key, f"out of range: {value!r}") from None


def event_from_json(data: object, *, archive: bool = False) -> UsageEvent:
    """Validate one JSON object of the documented schema; ``InputError.where`` names the bad field.

    ``archive``: the line is kvroute's own (a journal or dead-letter line), whose ``raw_usage`` beside ``usage`` is
    the archived copy the buckets came from; any other line giving both is refused: which one counts is not for the
    ledger to guess."""
    if not isinstance(data, Mapping):
        raise InputError("(line)", f"expected a JSON object, got {type(data).__name__}")
    unknown = set(data) - _KNOWN
    if unknown:
        raise InputError(sorted(unknown)[0], "unknown field")
    raw = data.get("raw_usage")
    if raw is not None and not isinstance(raw, Mapping):
        raise InputError("raw_usage", f"must be the provider's usage object, got {type(raw).__name__}")
    tokens_from_raw = False
    if raw is not None and data.get("usage") is not None and not archive and set(raw) - COST_ONLY:
        raise InputError("raw_usage", "holds token counts beside usage: give either usage (token buckets) or "
                                      "raw_usage (the provider's usage object), not both (raw_usage may carry just a "
                                      "cost beside usage)")
    if "usage" in data and data["usage"] is not None:
        if not isinstance(data["usage"], Mapping):
            raise InputError("usage", "must be an object of token buckets")
        tokens = TokenBuckets.from_dict(data["usage"])
    elif raw is not None:
        tokens_from_raw = True
        if not raw:
            raise InputError("raw_usage", "is empty: give the provider's usage object or token buckets in usage")
        tokens = normalize_usage(raw, _str(data, "usage_provider") or data.get("provider"), strict=True)
    else:
        raise InputError("usage", "is required (token buckets) unless raw_usage is given")
    currency = check_currency(data.get("currency", "USD"))
    costs = {k: (None if data.get(k) is None else to_decimal(data[k], k)) for k in ("provider_cost", "litellm_cost")}
    if costs["provider_cost"] is None and raw is not None:
        try:
            costs["provider_cost"] = reported_cost(raw)
        except InputError:
            if tokens_from_raw:  # with explicit buckets raw_usage is an archive copy: a bad cost there is ignored
                raise
    for key, value in costs.items():
        if value is not None and value < 0:
            raise InputError(key, f"must not be negative, got {value}")
    attempts = data.get("router_attempts")
    if attempts is not None and not isinstance(attempts, list):
        raise InputError("router_attempts", "must be a list")
    served = _str(data, "served_model", True)
    return UsageEvent(
        request_id=_str(data, "request_id", True), app_id=_str(data, "app_id", True),
        occurred_at=parse_time(data.get("occurred_at")) if "occurred_at" in data else _missing("occurred_at"),
        served_model=served, provider=_str(data, "provider", True), backend_id=_str(data, "backend_id", True),
        tokens=tokens, attempt=_optint(data, "attempt", 0), is_final=_bool(data, "final", True),
        status=data.get("status", "success"), requested_model=_str(data, "requested_model") or served,
        route_kind=data.get("route_kind", "direct"), end_user=_str(data, "end_user"),
        api_key_hash=_str(data, "api_key_hash"), http_status=_optint(data, "http_status"),
        error_type=_str(data, "error_type"), streamed=_bool(data, "streamed", False),
        sticky_hit=_bool(data, "sticky_hit", False), fallback_depth=_optint(data, "fallback_depth", 0),
        ttft_ms=_optint(data, "ttft_ms"), duration_ms=_optint(data, "duration_ms"),
        provider_cost=costs["provider_cost"], litellm_cost=costs["litellm_cost"], currency=currency,
        raw_usage=dict(raw) if raw is not None else None, router_attempts=attempts,
        attempt_key=_str(data, "attempt_key"), session_id=_str(data, "session_id"), tags=_tags(data),
        event_id=_str(data, "event_id") or "",
    )


def _tags(data: Mapping[str, Any]) -> tuple[str, ...]:
    value = data.get("tags")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError("tags", f"must be a list of strings, got {type(value).__name__}")
    check_tags(value)
    return tuple(sorted(set(value)))


def json_safe(value: Any) -> Any:
    """A copy of a JSON value that both databases store alike: ``Decimal`` becomes int or float, a non-finite
    number its text, and strings lose NUL characters and lone surrogates (PostgreSQL refuses both).

    Only the archived ``raw_usage``/``router_attempts`` pass through here (when stored and in ``to_json``);
    billed amounts were read from the exact ``Decimal`` before.
    """
    if value is None or isinstance(value, int):  # bool too; the common leaves first (a usage dict is mostly these)
        return value
    if isinstance(value, str):
        if value.isascii() and "\x00" not in value:
            return value
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode(errors="replace").decode()
        return value
    if isinstance(value, Decimal):
        if value.is_finite() and value == value.to_integral_value() and abs(value) < 2**63:
            return int(value)
        value = float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {json_safe(str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def _missing(key: str) -> datetime:
    raise InputError(key, "is required")
