"""Turn LiteLLM's callback payload into a ``UsageEvent`` without importing LiteLLM.

Reads plain dicts and objects: ``kwargs["standard_logging_object"]`` (``slo``), ``kwargs["litellm_params"]``
(``metadata``, ``model_info``), ``kwargs["response_cost"]``, and the response's ``usage``.

Attribution: the app comes from the authenticated key -- key metadata ``kvroute_app``, else the team id, else the
key alias. A client-supplied app (request ``metadata.kvroute_app`` or header ``x-kvroute-app``) is honoured only
when the key's metadata lists it in ``kvroute_trusted_apps`` (or holds ``"*"``). The end user comes from ``user``.

Provider cost, in order: the provider's reported cost (``usage.cost``, e.g. OpenRouter; a ``usage.cost`` equal
to LiteLLM's own ``response_cost``, LiteLLM's stamp of its bill on a stream, or on a ``self_hosted`` row, counts as
LiteLLM's),
LiteLLM's cost with LiteLLM's own margin taken out (``response_cost - cost_breakdown.margin_total_amount``),
then the ledger's rate card (a self-hosted amortised card comes before LiteLLM's cost, see ``pricing``).
A LiteLLM cost of 0 for tokens is "unpriced", not free.

Ids (see ``kvroute.billing.events.event_id_for``): ``request_id`` is the ledger request id kvroute assigned to the
client request and ``attempt`` kvroute's own attempt counter -- the plugin always passes both. Without them (a bare
library call) the payload's LiteLLM call id is used and the attempt is told apart by call id, deployment and start
time, so the same callback fired twice maps to the same event id. Never read from request metadata: a client can
write any ``metadata`` key, a trace id, ``x-session-id`` or (header ``x-litellm-call-id``) the call id.

Column limits: every string a client or provider controls is fitted to its ledger column (``fit``): longer values
keep their first characters and end in ``~`` plus 12 hex digits of their sha256, so distinct long values stay
distinct and the event is valid on SQLite and PostgreSQL alike; integers are clamped to the column's range.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kvroute.billing.events import ROUTE_KINDS, STATUSES, UsageEvent
from kvroute.billing.money import to_decimal
from kvroute.billing.usage import TokenBuckets, as_mapping, normalize_usage
from kvroute.policies.errors import InputError
from kvroute.policies.outcomes import classify

APP_KEY = "kvroute_app"
TRUSTED_KEY = "kvroute_trusted_apps"
APP_HEADER = "x-kvroute-app"
INT32_MAX = 2**31 - 1
ROUTER_BACKEND = "router"  # the backend of a router-level outcome (no deployment, cooldown): no upstream was called
ROUTER_PROVIDER = "litellm-router"
UNATTRIBUTED = "unattributed"  # the app of a request whose key names none

# ledger column widths (billing.models.UsageEventRow); kept here so building an event never imports SQLAlchemy
LIMITS = {"request_id": 200, "app_id": 200, "end_user": 200, "api_key_hash": 128, "requested_model": 200,
          "served_model": 200, "provider": 100, "backend_id": 200, "error_type": 100, "attempt_key": 200}


def fit(value: Any, limit: int) -> str:
    """``value`` as a string of at most ``limit`` characters (long ones: a prefix, ``~`` and a 12-hex sha256)."""
    raw = value if isinstance(value, str) else str(value)
    # PostgreSQL text holds neither NUL nor lone surrogates: replace them (SQLite and PostgreSQL store the same)
    text = raw.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if text and len(text) <= limit:
        return text
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return text[:limit - 13] + "~" + digest


def _fit_opt(value: Any, key: str) -> str | None:
    if value is None or value == "":
        return None
    return fit(value, LIMITS[key])


def _int32(value: Any) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return min(value, INT32_MAX)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _first(*values: Any) -> Any:
    for v in values:
        if v not in (None, ""):
            return v
    return None


def _money(value: Any) -> Decimal | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        amount = to_decimal(value)
    except InputError:
        return None
    return amount if amount >= 0 else None


def _moment(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.astimezone(UTC)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            return None
    return None


def resolve_app(slo_meta: Mapping[str, Any], params_meta: Mapping[str, Any], *,
                trust_unauthenticated: bool = False) -> str | None:
    """The billed app: from the key, or a client-supplied app the key is trusted for (see module docstring)."""
    key_meta = {**_dict(params_meta.get("user_api_key_metadata")), **_dict(slo_meta.get("user_api_key_auth_metadata"))}
    from_key = _first(key_meta.get(APP_KEY),
                      slo_meta.get("user_api_key_team_id"), params_meta.get("user_api_key_team_id"),
                      slo_meta.get("user_api_key_alias"), params_meta.get("user_api_key_alias"))
    requester = _dict(slo_meta.get("requester_metadata")) or _dict(params_meta.get("requester_metadata"))
    headers = {str(k).lower(): v for k, v in _dict(slo_meta.get("requester_custom_headers")).items()}
    claimed = _first(requester.get(APP_KEY), headers.get(APP_HEADER),
                     params_meta.get(APP_KEY) if from_key is None else None)
    if claimed is not None and isinstance(claimed, str):
        trusted = key_meta.get(TRUSTED_KEY)
        if isinstance(trusted, str):
            trusted = [t.strip() for t in trusted.split(",")]
        authenticated = from_key is not None or slo_meta.get("user_api_key_hash") or params_meta.get(
            "user_api_key_hash")
        if (isinstance(trusted, list) and ("*" in trusted or claimed in trusted)) or (
                not authenticated and trust_unauthenticated):
            return claimed
    return str(from_key) if from_key is not None else None


ROUTER_ERRORS = ("RouterRateLimitError", "NoDeploymentsAvailable", "No deployments available")


def is_router_error(error_class: str | None, message: str | None = None) -> bool:
    """LiteLLM's own refusal to route (no deployment left, group cooldown): no backend was called."""
    text = f"{error_class or ''} {message or ''}"
    return any(marker in text for marker in ROUTER_ERRORS)


def failure_status(http_status: int | None = None, error_class: str | None = None,
                   message: str | None = None, *, backend_called: bool | None = None) -> str:
    """The ledger status of a failed attempt or request -- the one place that maps an error to a status.

    ``no_route``: LiteLLM refused to route (no upstream call; never when ``backend_called``); ``cancelled``: the
    client went away; ``capacity``: 429/503/529 or a rate limit; ``client_error``: other 4xx but 408/409; else
    ``provider_failure``. For exception objects ``exception_status`` asks ``kvroute.policies.outcomes`` instead.
    """
    if not backend_called and is_router_error(error_class, message):
        return "no_route"
    if error_class and "cancel" in error_class.lower():
        return "cancelled"
    if http_status in (429, 503, 529) or (error_class and "RateLimit" in error_class):
        return "capacity"
    if http_status is not None and 400 <= http_status < 500 and http_status not in (408, 409):
        return "client_error"
    return "provider_failure"


def exception_status(exc: Any, *, backend_called: bool | None = None) -> tuple[str, int | None, str | None]:
    """(ledger status, HTTP status, error class) of an exception object: the outcome classifier decides the kind
    (the same verdict the breaker gets); anything that is not the router's, the client's or capacity is
    ``provider_failure``. Non-exceptions fall back to ``failure_status``."""
    code = getattr(exc, "status_code", None)
    http = code if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599 else None
    name = type(exc).__name__ if exc is not None else None
    if isinstance(exc, BaseException):
        return classify(exc, backend_called=backend_called).ledger_status, http, name
    status = failure_status(http, name, str(exc)[:300] if exc is not None else None, backend_called=backend_called)
    return status, http, name


def _usage_of(response_obj: Any, slo: Mapping[str, Any]) -> tuple[Any, TokenBuckets]:
    usage = _get(response_obj, "usage")
    if usage is None:
        usage = _first(_dict(slo.get("metadata")).get("usage_object"), _dict(slo.get("hidden_params")).get(
            "usage_object"))
    if usage is not None:
        raw = as_mapping(usage)
        if raw:
            return raw, normalize_usage(raw, slo.get("custom_llm_provider"))
    prompt, completion = slo.get("prompt_tokens") or 0, slo.get("completion_tokens") or 0
    raw = {"prompt_tokens": prompt, "completion_tokens": completion}
    return raw, normalize_usage(raw)


def event_from_callback(kwargs: Mapping[str, Any], response_obj: Any, *, outcome: str = "success",
                        attempt: int | None = None, final: bool | None = None, request_id: str | None = None,
                        app_id: str | None = None, backend_id: str | None = None, route_kind: str | None = None,
                        provider: str | None = None, served_model: str | None = None, sticky_hit: bool = False,
                        fallback_depth: int | None = None,
                        start_time: Any = None, end_time: Any = None, default_app: str | None = UNATTRIBUTED,
                        trust_unauthenticated: bool = False) -> UsageEvent | None:
    """Build the usage event of one LiteLLM callback, or ``None`` when the payload names no request or model.

    ``outcome`` is ``"success"``, ``"failure"`` (status derived from the error) or a ledger status. ``final``
    defaults to True for successes and False for failures (LiteLLM also reports failed attempts a retry later
    fixed); pass it, and ``attempt``, when the caller knows them. ``app_id`` overrides attribution; ``provider`` and
    ``served_model`` (the deployment's, from the plugin) come before the payload's, which differ between streamed,
    non-streamed and failed attempts.
    """
    slo = _dict(kwargs.get("standard_logging_object"))
    params = _dict(kwargs.get("litellm_params"))
    params_meta = {**_dict(kwargs.get("metadata")), **_dict(params.get("metadata"))}
    slo_meta = _dict(slo.get("metadata"))
    model_info = {**_dict(params_meta.get("model_info")), **_dict(params.get("model_info"))}
    rid = _first(request_id, slo.get("litellm_call_id"), kwargs.get("litellm_call_id"), slo.get("id"))
    served = _first(served_model, slo.get("model"), _dict(slo.get("hidden_params")).get("litellm_model_name"),
                    kwargs.get("model"))
    if rid is None or served is None:
        return None
    app = app_id or resolve_app(slo_meta, params_meta, trust_unauthenticated=trust_unauthenticated) or default_app
    if app is None:
        return None
    backend = str(_first(backend_id, slo.get("model_id"), model_info.get("id"), slo.get("api_base"), served))
    provider = str(_first(provider, model_info.get("kvroute_provider"), slo.get("custom_llm_provider"),
                          params.get("custom_llm_provider"), "unknown"))
    kind = _first(route_kind, model_info.get("kvroute_route_kind"))
    kind = kind if kind in ROUTE_KINDS else "direct"
    raw_usage, tokens = _usage_of(response_obj, slo)
    error = _dict(slo.get("error_information"))
    http_status = None
    code = _first(error.get("error_code"), _get(kwargs.get("exception"), "status_code"))
    if code is not None and str(code).isdigit() and len(str(code)) == 3:
        http_status = int(code)
    if outcome == "success":
        status = "success"
        finish = _get(_first(*(_get(response_obj, "choices") or [None])), "finish_reason")
        if tokens.output == 0 and finish in (None, "", "error"):
            status = "zero_completion"
    elif outcome == "failure":
        status = failure_status(http_status, error.get("error_class"), error.get("error_message"))
    elif outcome in STATUSES:
        status = str(outcome)
    elif outcome == "config_failure":  # kvroute.policies.health.Outcome: our side failed; never billed
        status = "provider_failure"
    else:
        raise ValueError(f"outcome must be 'success', 'failure' or one of {STATUSES}, got {outcome!r}")
    is_final = final if final is not None else outcome == "success"
    start = _first(_moment(start_time), _moment(slo.get("startTime"))) or datetime.now(UTC)
    end = _first(_moment(end_time), _moment(slo.get("endTime")))
    first_token = _moment(slo.get("completionStartTime"))
    ttft = int((first_token - start).total_seconds() * 1000) if first_token and first_token >= start else None
    duration = int((end - start).total_seconds() * 1000) if end and end >= start else None
    attempt_no = _int32(attempt)
    attempt_key = None
    if attempt_no is None:
        attempt_no = 0
        attempt_key = "|".join(str(x) for x in (slo.get("litellm_call_id") or kwargs.get("litellm_call_id"),
                                                slo.get("id"), backend, slo.get("startTime")))
    reported = _money(_get(_get(response_obj, "usage"), "cost"))
    if reported is None:
        reported = _money(raw_usage.get("cost")) if isinstance(raw_usage, Mapping) else None
    litellm_cost = _money(_first(kwargs.get("response_cost"), slo.get("response_cost")))
    if reported is not None and (reported == litellm_cost or kind == "self_hosted"):
        # LiteLLM stamps its own bill on a streamed usage.cost, and a replica reports no cost of its own: either
        # way the figure is LiteLLM's (the model_list price), not a provider's report
        litellm_cost = litellm_cost or reported  # a stream's hidden cost may still be 0
        reported = None
        if isinstance(raw_usage, Mapping) and "cost" in raw_usage:
            # not the provider's usage: kept out of raw_usage, so no later reader (the drainer's validation,
            # a re-ingest) takes LiteLLM's figure for a provider report
            raw_usage = {k: v for k, v in raw_usage.items() if k != "cost"}
    breakdown = _dict(slo.get("cost_breakdown"))
    margin = _money(breakdown.get("margin_total_amount"))
    if litellm_cost is not None and margin:
        litellm_cost = max(litellm_cost - margin, Decimal(0))
    if litellm_cost == 0 and tokens.prompt_total + tokens.output > 0:
        litellm_cost = None  # LiteLLM prices unknown models at 0.0: treat as unpriced, let the rate card decide
    end_user = _first(kwargs.get("user"), slo.get("end_user"), slo_meta.get("user_api_key_end_user_id"))
    depth = fallback_depth if fallback_depth is not None else params_meta.get("fallback_depth")
    error_type = error.get("error_class") or (type(kwargs["exception"]).__name__ if kwargs.get("exception") else None)
    return UsageEvent(
        request_id=fit(rid, LIMITS["request_id"]), app_id=fit(app, LIMITS["app_id"]), occurred_at=start,
        served_model=fit(served, LIMITS["served_model"]), provider=fit(provider, LIMITS["provider"]),
        backend_id=fit(backend, LIMITS["backend_id"]), tokens=tokens, attempt=attempt_no, is_final=is_final,
        status=status,
        requested_model=fit(_first(slo.get("model_group"), params_meta.get("model_group"), kwargs.get("model"),
                                   served), LIMITS["requested_model"]),
        route_kind=kind, end_user=_fit_opt(end_user, "end_user"),
        api_key_hash=_fit_opt(_first(slo_meta.get("user_api_key_hash"), params_meta.get("user_api_key_hash")),
                              "api_key_hash"),
        http_status=http_status, error_type=_fit_opt(error_type, "error_type"), streamed=bool(slo.get("stream")),
        sticky_hit=sticky_hit, fallback_depth=_int32(depth) or 0,
        ttft_ms=_int32(ttft), duration_ms=_int32(duration), provider_cost=reported, litellm_cost=litellm_cost,
        raw_usage=dict(raw_usage) if isinstance(raw_usage, Mapping) else None,
        attempt_key=_fit_opt(attempt_key, "attempt_key"),
    )


def cut_stream_usage(prompt_tokens: int, streamed_tokens: int,
                     prices: Mapping[str, Any]) -> tuple[dict[str, Any], Decimal | None]:
    """The usage and provider cost of an attempt whose stream was cut after ``streamed_tokens`` output tokens.

    Providers bill a cut stream like a finished one, for the tokens processed so far: the whole prompt (prefill
    ran) and the output generated up to the cut. kvroute knows the output it relayed and estimates the prompt from
    the request; no provider usage exists for it, so the cost is ``prompt × input_cost_per_token + output ×
    output_cost_per_token`` (exact decimals of the deployment's prices; None without prices: the rate card
    decides). The usage says it is an estimate (``kvroute_estimate``). The ledger books it non-final: its cost is
    absorbed, the app is billed nothing for it.
    """
    prompt, output = max(int(prompt_tokens), 0), max(int(streamed_tokens), 0)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
                             "kvroute_estimate": "stream_cut"}
    rate_in, rate_out = _money(prices.get("input_cost_per_token")), _money(prices.get("output_cost_per_token"))
    if rate_in is None or rate_out is None:
        return usage, None
    return usage, rate_in * prompt + rate_out * output
