"""LiteLLM callback payloads (shapes as LiteLLM 1.110.2 builds them) → UsageEvent."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from kvroute.billing.litellm_events import event_from_callback
from kvroute.billing.usage import TokenBuckets


def payload(**over: Any) -> dict[str, Any]:
    """A proxy success payload: standard_logging_object plus litellm_params, as seen by async_log_success_event."""
    slo = {
        "id": "chatcmpl-abc", "trace_id": "trace-1", "litellm_call_id": "call-1", "call_type": "acompletion",
        "stream": False, "response_cost": 0.0068, "status": "success", "custom_llm_provider": "hosted_vllm",
        "prompt_tokens": 4096, "completion_tokens": 64, "startTime": 1793620800.0, "endTime": 1793620801.5,
        "completionStartTime": 1793620800.25, "model": "llama-8b", "model_id": "vllm-a", "model_group": "llama",
        "api_base": "http://127.0.0.1:30001/v1", "end_user": "cust-9",
        "cost_breakdown": {"input_cost": 0.0008, "output_cost": 0.006, "cache_read_cost": 0.0, "total_cost": 0.0068},
        "metadata": {"user_api_key_hash": "hash-1", "user_api_key_alias": "acme-prod", "user_api_key_team_id": None,
                     "user_api_key_auth_metadata": None, "requester_metadata": {}, "requester_custom_headers": {}},
        "hidden_params": {"litellm_model_name": "hosted_vllm/llama-8b"},
        "error_information": None,
    }
    slo.update(over.pop("slo", {}))
    kwargs = {"standard_logging_object": slo, "response_cost": slo["response_cost"], "user": "cust-9",
              "litellm_params": {"metadata": {"user_api_key_alias": "acme-prod", "user_api_key_metadata": {},
                                              "model_group": "llama"},
                                 "model_info": {"id": "vllm-a", "kvroute_route_kind": "self_hosted"}}}
    kwargs.update(over)
    return kwargs


RESPONSE = {"id": "chatcmpl-abc", "choices": [{"finish_reason": "stop", "message": {"content": "hi"}}],
            "usage": {"prompt_tokens": 4096, "completion_tokens": 64,
                      "prompt_tokens_details": {"cached_tokens": 3968}}}


def test_success_event_fields() -> None:
    e = event_from_callback(payload(), RESPONSE)
    assert e is not None
    assert (e.app_id, e.end_user, e.request_id, e.backend_id, e.route_kind) == (
        "acme-prod", "cust-9", "call-1", "vllm-a", "self_hosted")  # the trace id is client-settable: never used
    assert (e.served_model, e.requested_model, e.provider, e.status, e.is_final) == (
        "llama-8b", "llama", "hosted_vllm", "success", True)
    assert e.tokens == TokenBuckets(128, 3968, 0, 0, 64, 0)
    assert e.ttft_ms == 250 and e.duration_ms == 1500 and e.api_key_hash == "hash-1"
    assert e.litellm_cost == Decimal("0.0068") and e.provider_cost is None


def test_fired_twice_gives_one_event_id() -> None:
    a = event_from_callback(payload(), RESPONSE)
    b = event_from_callback(payload(), RESPONSE)
    assert a is not None and b is not None and a.event_id == b.event_id
    retry = event_from_callback(payload(slo={"startTime": 1793620802.0, "model_id": "vllm-b"}), RESPONSE)
    assert retry is not None and retry.event_id != a.event_id and retry.request_id == a.request_id
    explicit = event_from_callback(payload(), RESPONSE, attempt=1)
    assert explicit is not None and explicit.attempt == 1 and explicit.event_id != a.event_id


def test_litellm_margin_is_taken_out_and_reported_cost_wins() -> None:
    kw = payload(slo={"response_cost": 0.00816, "cost_breakdown": {"original_cost": 0.0068, "total_cost": 0.00816,
                                                                   "margin_percent": 0.2,
                                                                   "margin_total_amount": 0.00136}})
    kw["response_cost"] = 0.00816
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.litellm_cost == Decimal("0.0068")
    openrouter = {**RESPONSE, "usage": {**RESPONSE["usage"], "cost": 0.00492}}
    e = event_from_callback(kw, openrouter, route_kind="marketplace")  # a provider that reports its own cost
    assert e is not None and e.provider_cost == Decimal("0.00492")
    # LiteLLM stamps its own bill (margin included) on a streamed usage.cost: LiteLLM's cost, not a report
    stamped = {**RESPONSE, "usage": {**RESPONSE["usage"], "cost": 0.00816}}
    e = stamped_event = event_from_callback(kw, stamped, route_kind="marketplace")
    assert e is not None and e.provider_cost is None and e.litellm_cost == Decimal("0.0068")
    replica = event_from_callback(kw, {**RESPONSE, "usage": {**RESPONSE["usage"], "cost": 0.005}},
                                  route_kind="self_hosted")
    assert replica is not None and replica.provider_cost is None  # a replica reports no cost of its own
    kw = payload(slo={"response_cost": 0.0})  # a stream's hidden params before LiteLLM priced it
    kw["response_cost"] = 0.0
    replica = event_from_callback(kw, {**RESPONSE, "usage": {**RESPONSE["usage"], "cost": 0.005}},
                                  route_kind="self_hosted")
    assert replica is not None and replica.litellm_cost == Decimal("0.005") and replica.provider_cost is None
    # the documented form (what the drainer validates, what a re-ingest reads) keeps that decision: LiteLLM's
    # figure is not left in raw_usage for the raw_usage.cost rule to take for a provider report
    import json

    from kvroute.billing.events import event_from_json
    for e in (replica, stamped_event):
        back = event_from_json(json.loads(e.to_line()), archive=True)
        assert back.provider_cost is None and back.litellm_cost == e.litellm_cost and "cost" not in back.raw_usage


def test_unpriced_zero_cost_is_unknown() -> None:
    kw = payload(slo={"response_cost": 0.0})
    kw["response_cost"] = 0.0
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.litellm_cost is None


def test_app_from_key_metadata_and_trusted_client_app() -> None:
    kw = payload()
    kw["litellm_params"]["metadata"]["user_api_key_metadata"] = {"kvroute_app": "acme"}
    kw["standard_logging_object"]["metadata"]["requester_metadata"] = {"kvroute_app": "evil"}
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.app_id == "acme"  # client claim ignored: the key is not trusted for it
    kw["litellm_params"]["metadata"]["user_api_key_metadata"]["kvroute_trusted_apps"] = ["sub-app"]
    kw["standard_logging_object"]["metadata"]["requester_metadata"] = {"kvroute_app": "sub-app"}
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.app_id == "sub-app"
    kw["standard_logging_object"]["metadata"]["user_api_key_team_id"] = "team-7"
    kw["litellm_params"]["metadata"]["user_api_key_metadata"] = {}
    kw["standard_logging_object"]["metadata"]["requester_metadata"] = {}
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.app_id == "team-7"


def test_sdk_without_key_uses_default_app_unless_trusted() -> None:
    kw = payload()
    kw["standard_logging_object"]["metadata"] = {}
    kw["litellm_params"]["metadata"] = {"kvroute_app": "claimed"}
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.app_id == "unattributed"
    e = event_from_callback(kw, RESPONSE, trust_unauthenticated=True)
    assert e is not None and e.app_id == "claimed"
    assert event_from_callback(kw, RESPONSE, default_app=None) is None


def test_failure_payload() -> None:
    kw = payload(slo={"status": "failure", "response_cost": 0.0, "prompt_tokens": 0, "completion_tokens": 0,
                      "error_information": {"error_code": "503", "error_class": "ServiceUnavailableError"}})
    kw["response_cost"] = None
    e = event_from_callback(kw, None, outcome="failure")
    # a 503 without Retry-After: the provider failed (the breaker's verdict of the same exception, ``classify``)
    assert e is not None and e.status == "provider_failure" and e.http_status == 503 and not e.is_final
    assert e.tokens == TokenBuckets()
    kw["standard_logging_object"]["error_information"] = {"error_code": "500", "error_class": "InternalServerError"}
    e = event_from_callback(kw, None, outcome="failure", final=True)
    assert e is not None and e.status == "provider_failure" and e.is_final
    from kvroute.policies.health import Outcome
    e = event_from_callback(kw, None, outcome=Outcome.CAPACITY)
    assert e is not None and e.status == "capacity"


def test_zero_completion_and_streaming_anthropic() -> None:
    empty = {"choices": [{"finish_reason": None, "message": {"content": ""}}],
             "usage": {"prompt_tokens": 10, "completion_tokens": 0}}
    e = event_from_callback(payload(), empty)
    assert e is not None and e.status == "zero_completion"
    # LiteLLM's assembled stream response for Anthropic: Usage with inclusive prompt_tokens
    stream = {"choices": [{"finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5725, "completion_tokens": 42, "cache_read_input_tokens": 5000,
                        "cache_creation_input_tokens": 700,
                        "prompt_tokens_details": {"cached_tokens": 5000, "cache_write_tokens": 700}}}
    e = event_from_callback(payload(slo={"stream": True, "custom_llm_provider": "anthropic"}), stream)
    assert e is not None and e.streamed and e.tokens == TokenBuckets(25, 5000, 700, 0, 42, 0)


def test_usage_object_from_litellm_types() -> None:
    from litellm.types.utils import ModelResponse, Usage
    response = ModelResponse(id="x", choices=[{"message": {"content": "ok"}, "finish_reason": "stop"}],
                             usage=Usage(prompt_tokens=1500, completion_tokens=80, prompt_cache_hit_tokens=1280,
                                         prompt_cache_miss_tokens=220))
    e = event_from_callback(payload(slo={"custom_llm_provider": "deepseek"}), response)
    assert e is not None and e.tokens == TokenBuckets(220, 1280, 0, 0, 80, 0)


@pytest.mark.parametrize("bad", [{}, {"standard_logging_object": {"model": "m"}}])
def test_unusable_payload_is_none(bad: dict[str, Any]) -> None:
    assert event_from_callback(bad, None) is None


def test_client_controlled_strings_fit_the_columns_and_stay_distinct() -> None:
    from kvroute.billing.litellm_events import LIMITS
    long_a, long_b = "u" * 201 + "a", "u" * 201 + "b"
    a = event_from_callback(payload(user=long_a), RESPONSE, request_id="r1", attempt=1)
    b = event_from_callback(payload(user=long_b), RESPONSE, request_id="r1", attempt=1)
    assert a is not None and b is not None
    assert len(a.end_user) == LIMITS["end_user"] and a.end_user != b.end_user and a.end_user.startswith("u" * 150)
    weird = event_from_callback(payload(user="\x00\ud800x"), RESPONSE, request_id="r1", attempt=1)
    assert weird is not None and weird.end_user is not None and "\x00" not in weird.end_user
    weird.to_line().encode()  # no lone surrogate left


def test_metadata_attempt_and_request_keys_are_never_read() -> None:
    kw = payload()
    kw["litellm_params"]["metadata"].update(kvroute_attempt=10**30, kvroute_request_id="evil", fallback_depth=2**40)
    e = event_from_callback(kw, RESPONSE)
    assert e is not None and e.request_id == "call-1" and e.attempt == 0 and e.fallback_depth <= 2**31 - 1


def test_failure_status_is_one_function() -> None:
    from kvroute.billing.litellm_events import failure_status
    assert failure_status(429, "RouterRateLimitError", "No deployments available for selected model") == "no_route"
    assert failure_status(429, "RateLimitError") == "capacity"
    assert failure_status(500, "InternalServerError") == "provider_failure"
    assert failure_status(400, "BadRequestError") == "client_error"
    assert failure_status(None, "CancelledError") == "cancelled"


@pytest.mark.parametrize(("status", "cls"), [
    (409, "ConflictError"), (503, "ServiceUnavailableError"), (529, "APIError"), (503, "OverloadedError"),
    (429, "RateLimitError"), (404, "NotFoundError"), (408, "Timeout"), (400, "BadRequestError"),
    (499, "HTTPException"), (500, "InternalServerError"), (None, "APIConnectionError"), (None, "ReadTimeout"),
    (None, "RateLimitError"), (None, "AuthenticationError"), (None, "CancelledError"), (None, "WeirdError")])
def test_the_logged_fields_get_the_verdict_the_breaker_gets_for_the_same_exception(status, cls) -> None:
    """One classifier: a failure known by its logged fields is booked as ``classify`` judges the exception."""
    from kvroute.billing.litellm_events import failure_status
    from kvroute.policies.outcomes import classify

    error = type(cls, (Exception,), {"__module__": "litellm.exceptions"})("upstream said no")
    if status is not None:
        error.status_code = status
    assert failure_status(status, cls, "upstream said no", backend_called=True) == \
        classify(error, backend_called=True).ledger_status
