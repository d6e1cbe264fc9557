"""Turn LiteLLM's callback payload into a ``UsageEvent`` without importing LiteLLM.

Reads plain dicts and objects: ``kwargs["standard_logging_object"]`` (``slo``), ``kwargs["litellm_params"]``
(``metadata``, ``model_info``), ``kwargs["response_cost"]``, and the response's ``usage``.

Attribution: the app comes from the authenticated key -- key metadata ``kvroute_app``, else the team id, else the
key alias. A client-supplied app (request ``metadata.kvroute_app`` or header ``x-kvroute-app``) is honoured only
when the key's metadata lists it in ``kvroute_trusted_apps`` (or holds ``"*"``). The end user comes from ``user``.

Provider cost, in order: the provider's reported cost (``usage.cost``, e.g. OpenRouter), LiteLLM's cost with
LiteLLM's own margin taken out (``response_cost - cost_breakdown.margin_total_amount``), then the ledger's rate
card. A LiteLLM cost of 0 for tokens is "unpriced", not free.

Ids: ``request_id`` is the LiteLLM trace id (shared by retries and fallbacks) unless given; each attempt is told
apart by ``attempt`` when the caller knows it, else by the payload's call id, deployment and start time, so the
same callback fired twice maps to the same event id and never bills twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kvroute.billing.events import ROUTE_KINDS, STATUSES, UsageEvent
from kvroute.billing.money import to_decimal
from kvroute.billing.usage import TokenBuckets, as_mapping, normalize_usage
from kvroute.policies.errors import InputError

APP_KEY = "kvroute_app"
TRUSTED_KEY = "kvroute_trusted_apps"
APP_HEADER = "x-kvroute-app"


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
        return datetime.fromtimestamp(value, UTC)
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


def _failure_status(http_status: int | None, error_class: str | None) -> str:
    if error_class and "cancel" in error_class.lower():
        return "cancelled"
    if http_status in (429, 503, 529) or (error_class and "RateLimit" in error_class):
        return "capacity"
    if http_status is not None and 400 <= http_status < 500 and http_status not in (408, 409):
        return "client_error"
    return "provider_failure"


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
                        sticky_hit: bool = False, fallback_depth: int | None = None,
                        start_time: Any = None, end_time: Any = None, default_app: str | None = "unattributed",
                        trust_unauthenticated: bool = False) -> UsageEvent | None:
    """Build the usage event of one LiteLLM callback, or ``None`` when the payload names no request or model.

    ``outcome`` is ``"success"``, ``"failure"`` (status derived from the error) or a ledger status. ``final``
    defaults to True for successes and False for failures (LiteLLM also reports failed attempts a retry later
    fixed); pass it, and ``attempt``, when the caller knows them. ``app_id`` overrides attribution.
    """
    slo = _dict(kwargs.get("standard_logging_object"))
    params = _dict(kwargs.get("litellm_params"))
    params_meta = {**_dict(kwargs.get("metadata")), **_dict(params.get("metadata"))}
    slo_meta = _dict(slo.get("metadata"))
    model_info = {**_dict(params_meta.get("model_info")), **_dict(params.get("model_info"))}
    rid = _first(request_id, params_meta.get("kvroute_request_id"), slo.get("trace_id"),
                 kwargs.get("litellm_trace_id"), slo.get("litellm_call_id"), kwargs.get("litellm_call_id"),
                 slo.get("id"))
    served = _first(slo.get("model"), _dict(slo.get("hidden_params")).get("litellm_model_name"), kwargs.get("model"))
    if rid is None or served is None:
        return None
    app = app_id or resolve_app(slo_meta, params_meta, trust_unauthenticated=trust_unauthenticated) or default_app
    if app is None:
        return None
    backend = str(_first(backend_id, slo.get("model_id"), model_info.get("id"), slo.get("api_base"), served))
    provider = str(_first(slo.get("custom_llm_provider"), params.get("custom_llm_provider"),
                          model_info.get("kvroute_provider"), "unknown"))
    kind = _first(route_kind, model_info.get("kvroute_route_kind"))
    kind = kind if kind in ROUTE_KINDS else "direct"
    raw_usage, tokens = _usage_of(response_obj, slo)
    error = _dict(slo.get("error_information"))
    http_status = None
    code = _first(error.get("error_code"), _get(kwargs.get("exception"), "status_code"))
    if code is not None and str(code).isdigit():
        http_status = int(code)
    if outcome == "success":
        status = "success"
        finish = _get(_first(*(_get(response_obj, "choices") or [None])), "finish_reason")
        if tokens.output == 0 and finish in (None, "", "error"):
            status = "zero_completion"
    elif outcome == "failure":
        status = _failure_status(http_status, error.get("error_class"))
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
    attempt_no = attempt if attempt is not None else params_meta.get("kvroute_attempt")
    attempt_key = None
    if not isinstance(attempt_no, int) or isinstance(attempt_no, bool) or attempt_no < 0:
        attempt_no = 0
        attempt_key = "|".join(str(x) for x in (slo.get("litellm_call_id") or kwargs.get("litellm_call_id"),
                                                slo.get("id"), backend, slo.get("startTime")))
    reported = _money(_get(_get(response_obj, "usage"), "cost"))
    if reported is None:
        reported = _money(raw_usage.get("cost")) if isinstance(raw_usage, Mapping) else None
    litellm_cost = _money(_first(kwargs.get("response_cost"), slo.get("response_cost")))
    breakdown = _dict(slo.get("cost_breakdown"))
    margin = _money(breakdown.get("margin_total_amount"))
    if litellm_cost is not None and margin:
        litellm_cost = max(litellm_cost - margin, Decimal(0))
    if litellm_cost == 0 and tokens.prompt_total + tokens.output > 0:
        litellm_cost = None  # LiteLLM prices unknown models at 0.0: treat as unpriced, let the rate card decide
    end_user = _first(kwargs.get("user"), slo.get("end_user"), slo_meta.get("user_api_key_end_user_id"))
    depth = fallback_depth if fallback_depth is not None else params_meta.get("fallback_depth")
    return UsageEvent(
        request_id=str(rid), app_id=str(app), occurred_at=start, served_model=str(served), provider=provider,
        backend_id=backend, tokens=tokens, attempt=attempt_no, is_final=is_final, status=status,
        requested_model=str(_first(slo.get("model_group"), params_meta.get("model_group"), kwargs.get("model"),
                                   served)),
        route_kind=kind, end_user=str(end_user) if end_user is not None else None,
        api_key_hash=_first(slo_meta.get("user_api_key_hash"), params_meta.get("user_api_key_hash")),
        http_status=http_status, error_type=error.get("error_class"), streamed=bool(slo.get("stream")),
        sticky_hit=sticky_hit, fallback_depth=depth if isinstance(depth, int) and depth >= 0 else 0,
        ttft_ms=ttft, duration_ms=duration, provider_cost=reported, litellm_cost=litellm_cost,
        raw_usage=dict(raw_usage) if isinstance(raw_usage, Mapping) else None, attempt_key=attempt_key,
    )
