"""Read LiteLLM's callback payload as ``CallFacts`` and book it (``event_from_callback``) without importing LiteLLM.

Reads plain dicts and objects: ``kwargs["standard_logging_object"]`` (``slo``), ``kwargs["litellm_params"]``
(``metadata``, ``model_info``), ``kwargs["response_cost"]``, and the response's ``usage``. The billing rules (status,
provider cost, column limits) are ``call_facts.event_from_facts``'s.

Attribution: the app is the one rule of ``kvroute.billing.attribution`` (from the authenticated key; a client's claim
only where the key trusts it, or with ``trust_unauthenticated`` for a caller without proxy auth). The plugin resolves
it once per request and passes ``app_id``. The end user comes from ``user``.

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
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kvroute.billing.attribution import APP_HEADER, APP_KEY, TRUSTED_KEY, UNATTRIBUTED, app_of
from kvroute.billing.call_facts import LIMITS, CallFacts, event_from_facts, fit, int32, moment, money
from kvroute.billing.call_facts import as_dict as _dict
from kvroute.billing.call_facts import first_given as _first
from kvroute.billing.events import STATUSES, UsageEvent
from kvroute.billing.usage import as_mapping
from kvroute.policies.outcomes import classify, classify_fields

__all__ = ["APP_HEADER", "APP_KEY", "LIMITS", "ROUTER_BACKEND", "ROUTER_PROVIDER", "STATUSES", "TRUSTED_KEY",
           "UNATTRIBUTED", "CallFacts", "cut_stream_usage", "event_from_callback", "event_from_facts",
           "exception_status", "facts_from_callback", "failure_status", "fit", "read_error", "read_response"]

ROUTER_BACKEND = "router"  # the backend of a router-level outcome (no deployment, cooldown): no upstream was called
ROUTER_PROVIDER = "litellm-router"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


ROUTER_ERRORS = ("RouterRateLimitError", "NoDeploymentsAvailable", "No deployments available")


def is_router_error(error_class: str | None, message: str | None = None) -> bool:
    """LiteLLM's own refusal to route (no deployment left, group cooldown): no backend was called."""
    text = f"{error_class or ''} {message or ''}"
    return any(marker in text for marker in ROUTER_ERRORS)


def failure_status(http_status: int | None = None, error_class: str | None = None,
                   message: str | None = None, *, backend_called: bool | None = None) -> str:
    """The ledger status of a failure known by its logged fields: the view of ``policies.outcomes`` verdict the
    breaker gets (``classify_fields``: the same table as ``classify`` for exception objects) -- ``no_route``,
    ``cancelled``, ``capacity``, ``client_error`` or ``provider_failure``."""
    return classify_fields(http_status, error_class, message, backend_called=backend_called).ledger_status


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


def read_response(response_obj: Any) -> tuple[Any, Any, Any]:
    """(usage, the cost that usage reports, the first choice's finish reason) of a response object or dict."""
    usage = _get(response_obj, "usage")
    return usage, _get(usage, "cost"), _get(_first(*(_get(response_obj, "choices") or [None])), "finish_reason")


def read_error(exc: Any, error_information: Mapping[str, Any] | None = None) -> tuple[int | None, str | None]:
    """(HTTP status, error type) of a failed call: LiteLLM's ``error_information`` first, then the exception's
    ``status_code`` (three digits, else none) and class name."""
    error = error_information or {}
    code = _first(error.get("error_code"), _get(exc, "status_code"))
    http_status = int(code) if code is not None and str(code).isdigit() and len(str(code)) == 3 else None
    return http_status, error.get("error_class") or (type(exc).__name__ if exc else None)


def facts_from_callback(kwargs: Mapping[str, Any], response_obj: Any, *, outcome: str = "success",
                        attempt: int | None = None, final: bool | None = None, request_id: str | None = None,
                        app_id: str | None = None, backend_id: str | None = None, route_kind: str | None = None,
                        provider: str | None = None, served_model: str | None = None, sticky_hit: bool = False,
                        fallback_depth: int | None = None, start_time: Any = None, end_time: Any = None,
                        default_app: str | None = UNATTRIBUTED, trust_unauthenticated: bool = False,
                        exception: Any = None, model: str | None = None) -> CallFacts | None:
    """The facts of one LiteLLM callback (see ``event_from_callback``), or ``None`` when the payload names no
    request, model or app; ``exception`` and ``model`` (the model the attempt was sent with) come before the
    payload's own."""
    slo = _dict(kwargs.get("standard_logging_object"))
    params = _dict(kwargs.get("litellm_params"))
    params_meta = {**_dict(kwargs.get("metadata")), **_dict(params.get("metadata"))}
    slo_meta = _dict(slo.get("metadata"))
    model_info = {**_dict(params_meta.get("model_info")), **_dict(params.get("model_info"))}
    rid = _first(request_id, slo.get("litellm_call_id"), kwargs.get("litellm_call_id"), slo.get("id"))
    served = _first(served_model, slo.get("model"), _dict(slo.get("hidden_params")).get("litellm_model_name"),
                    _first(model, kwargs.get("model")))
    if rid is None or served is None:
        return None
    app = app_id or app_of(params_meta, slo_meta=slo_meta, operator_call=trust_unauthenticated) or default_app
    if app is None:
        return None
    backend = str(_first(backend_id, slo.get("model_id"), model_info.get("id"), slo.get("api_base"), served))
    usage, reported, finish = read_response(response_obj)
    if usage is None:
        usage = _first(_dict(slo.get("metadata")).get("usage_object"), _dict(slo.get("hidden_params")).get(
            "usage_object"))
    error = _dict(slo.get("error_information"))
    http_status, error_type = read_error(exception if exception is not None else kwargs.get("exception"), error)
    if outcome == "failure":
        outcome = failure_status(http_status, error.get("error_class"), error.get("error_message"))
    attempt_key = None
    if int32(attempt) is None:
        attempt_key = "|".join(str(x) for x in (slo.get("litellm_call_id") or kwargs.get("litellm_call_id"),
                                                slo.get("id"), backend, slo.get("startTime")))
    return CallFacts(
        request_id=rid, app_id=app, served_model=served, backend_id=backend,
        requested_model=_first(slo.get("model_group"), params_meta.get("model_group"), model, kwargs.get("model")),
        provider=_first(provider, model_info.get("kvroute_provider"), slo.get("custom_llm_provider"),
                        params.get("custom_llm_provider")),
        route_kind=_first(route_kind, model_info.get("kvroute_route_kind")), outcome=outcome, final=final,
        attempt=attempt, attempt_key=attempt_key,
        usage=as_mapping(usage) if usage is not None else None, usage_provider=slo.get("custom_llm_provider"),
        prompt_tokens=slo.get("prompt_tokens") or 0, completion_tokens=slo.get("completion_tokens") or 0,
        reported_cost=reported,
        litellm_cost=money(_first(kwargs.get("response_cost"), slo.get("response_cost"))),
        litellm_margin=money(_dict(slo.get("cost_breakdown")).get("margin_total_amount")),
        finish_reason=finish, http_status=http_status, error_type=error_type,
        streamed=bool(slo.get("stream")), sticky_hit=sticky_hit,
        fallback_depth=fallback_depth if fallback_depth is not None else params_meta.get("fallback_depth"),
        start=_first(moment(start_time), moment(slo.get("startTime"))),
        end=_first(moment(end_time), moment(slo.get("endTime"))), first_token=moment(slo.get("completionStartTime")),
        end_user=_first(kwargs.get("user"), slo.get("end_user"), slo_meta.get("user_api_key_end_user_id")),
        api_key_hash=_first(slo_meta.get("user_api_key_hash"), params_meta.get("user_api_key_hash")),
    )


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
    facts = facts_from_callback(
        kwargs, response_obj, outcome=outcome, attempt=attempt, final=final, request_id=request_id, app_id=app_id,
        backend_id=backend_id, route_kind=route_kind, provider=provider, served_model=served_model,
        sticky_hit=sticky_hit, fallback_depth=fallback_depth, start_time=start_time, end_time=end_time,
        default_app=default_app, trust_unauthenticated=trust_unauthenticated)
    return event_from_facts(facts) if facts is not None else None


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
    rate_in, rate_out = money(prices.get("input_cost_per_token")), money(prices.get("output_cost_per_token"))
    if rate_in is None or rate_out is None:
        return usage, None
    return usage, rate_in * prompt + rate_out * output
