"""What the hooks read from LiteLLM payloads: cached tokens per provider shape, TTFT, failure classes."""

from __future__ import annotations

from datetime import datetime, timedelta
from types import SimpleNamespace

import httpx
import litellm
import pytest

from kvroute.plugin.adapter.signals import breaker_config, cached_tokens_of, ttft_of
from kvroute.policies.errors import ConfigError
from kvroute.policies.outcomes import classify


def test_cached_tokens_openai_anthropic_llamacpp_shapes():
    openai_like = SimpleNamespace(usage=SimpleNamespace(prompt_tokens_details=SimpleNamespace(cached_tokens=512)))
    assert cached_tokens_of(openai_like) == 512
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}) == 0
    assert cached_tokens_of({"usage": {"cache_read_input_tokens": 300, "input_tokens": 20}}) == 300
    assert cached_tokens_of({"usage": {"prompt_tokens": 9}, "timings": {"cache_n": 64, "prompt_n": 9}}) == 64
    assert cached_tokens_of({"usage": {"prompt_tokens": 9}}) is None
    assert cached_tokens_of(None) is None
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": -3}}}) is None


def test_litellm_maps_anthropic_cache_reads_into_prompt_tokens_details():
    usage = litellm.Usage(prompt_tokens=10, completion_tokens=1, total_tokens=11, cache_read_input_tokens=700)
    resp = litellm.ModelResponse(usage=usage)
    assert cached_tokens_of(resp) == 700


def test_llamacpp_timings_on_a_response_object():
    resp = SimpleNamespace(usage=SimpleNamespace(prompt_tokens=5, prompt_tokens_details=None),
                           timings={"cache_n": 128, "prompt_n": 5})
    assert cached_tokens_of(resp) == 128


def test_ttft_from_standard_logging_payload_and_start_time():
    start = datetime(2026, 1, 1, 12, 0, 0)
    slo = {"startTime": start.timestamp(), "completionStartTime": start.timestamp() + 0.25}
    assert ttft_of({}, slo, None, None) == pytest.approx(0.25)
    assert ttft_of({"completion_start_time": start + timedelta(seconds=1.5)}, {}, start, None) == pytest.approx(1.5)
    assert ttft_of({}, {"startTime": 10.0, "completionStartTime": 5.0}, None, None) is None
    assert ttft_of({}, {}, None, None) is None


def _status_error(status: int, retry_after: str | None = None) -> Exception:
    headers = {"retry-after": retry_after} if retry_after else {}
    response = httpx.Response(status, headers=headers, request=httpx.Request("POST", "http://x/v1"))
    err = litellm.exceptions.RateLimitError if status == 429 else litellm.exceptions.InternalServerError
    if status in (401,):
        err = litellm.exceptions.AuthenticationError
    if status == 400:
        err = litellm.exceptions.BadRequestError
    exc = err(message="boom", llm_provider="openai", model="m", response=response)
    return exc


@pytest.mark.parametrize(("status", "retry_after", "outcome", "blames"), [
    (500, None, "provider_failure", True),
    (429, "7", "capacity", True),
    (401, None, "config_failure", True),
    (400, None, "client_error", False),
])
def test_classify_litellm_exceptions(status, retry_after, outcome, blames):
    f = classify(_status_error(status, retry_after), backend_called=True)
    assert f.outcome == outcome and f.status == status and f.blames_backend is blames
    if retry_after:
        assert f.retry_after_s == 7.0


def test_classify_real_litellm_connection_router_and_precall_errors():
    import asyncio

    assert classify(litellm.exceptions.APIConnectionError(message="Connection error.", llm_provider="openai",
                                                          model="m")).outcome == "provider_failure"
    assert classify(litellm.exceptions.Timeout(message="t", model="m", llm_provider="openai")).outcome \
        == "provider_failure"
    assert classify(asyncio.CancelledError()).outcome == "cancelled"
    assert classify(None).outcome == "provider_failure"
    from litellm.types.router import RouterRateLimitError

    no_deployments = RouterRateLimitError(model="llama", cooldown_time=5, enable_pre_call_checks=False,
                                          cooldown_list=[])
    assert not classify(no_deployments, backend_called=True).blames_backend
    try:
        try:
            iter(5)  # type: ignore[call-overload]
        except TypeError as inner:
            raise litellm.exceptions.APIConnectionError(message=str(inner), llm_provider="openai",
                                                        model="m") from inner
    except litellm.exceptions.APIConnectionError as pre_call:
        verdict = classify(pre_call, backend_called=True)
    assert verdict.kind == "request_rejected" and not verdict.blames_backend
    budget = litellm.BudgetExceededError(current_cost=2.0, max_budget=1.0)
    assert not classify(budget, backend_called=True).blames_backend


def test_breaker_config_errors_name_the_key():
    assert breaker_config({"consecutive_failures": 2}).consecutive_failures == 2
    with pytest.raises(ConfigError) as err:
        breaker_config({"nope": 1})
    assert err.value.key == "kvroute.breaker.nope"
    with pytest.raises(ConfigError) as err:
        breaker_config({"error_rate": 3})
    assert err.value.key == "kvroute.breaker.error_rate"


@pytest.mark.slow
def test_singleton_is_lazy_and_bad_config_names_the_key(tmp_path):
    import os
    import subprocess
    import sys

    code = """
import sys, kvroute.plugin as p
assert "kvroute.plugin.adapter.litellm_hooks" not in sys.modules      # nothing heavy until asked for
try:
    p.kvroute_callback
except Exception as exc:
    print(type(exc).__name__, exc.key)
"""
    env = {**os.environ, "KVROUTE_GROUPS": '{"llama": {"policy": "cache_aware", "knobs": {"bad": 1}}}'}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ConfigError kvroute.groups.llama.knobs.bad", out.stderr[-2000:]
    env["KVROUTE_GROUPS"] = '{"llama": {"policy": "least_load"}}'
    code_ok = "import kvroute.plugin as p; cb = p.kvroute_callback; assert cb is p.kvroute_callback; " \
              "print(cb.settings.group('llama').policy)"
    out = subprocess.run([sys.executable, "-c", code_ok], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "least_load", out.stderr[-2000:]


def test_cache_key_forwarding_rules():
    from kvroute.plugin.adapter.deployments import classify
    from kvroute.plugin.adapter.hosted import forward_cache_key

    def backend(model, api_base=None):
        return classify({"model_name": "g", "litellm_params": {"model": model, "api_base": api_base},
                         "model_info": {"id": "b"}})

    kw = {"model": "x"}
    assert forward_cache_key(kw, backend("openai/gpt-4o"), "kvr-1")["prompt_cache_key"] == "kvr-1"
    kw = {"prompt_cache_key": "mine"}
    assert forward_cache_key(kw, backend("openai/gpt-4o"), "kvr-1") is None and kw["prompt_cache_key"] == "mine"
    kw = {"extra_body": {"other": 1}}
    out = forward_cache_key(kw, backend("openrouter/deepseek/deepseek-chat"), "kvr-2")
    assert out["extra_body"] == {"other": 1, "session_id": "kvr-2"}
    kw = {"extra_body": {"session_id": "user"}}
    assert forward_cache_key(kw, backend("openrouter/x/y"), "kvr-2") is None
    assert forward_cache_key({}, backend("anthropic/claude-3-5-sonnet-20240620"), "kvr-3") is None
    assert forward_cache_key({}, backend("openai/m", "https://api.shareai.now/v1"), "k")["prompt_cache_key"] == "k"
