"""The hook's side of attribution, called directly: LiteLLM's request-level failure event must not charge the
ticket of a newer attempt (a fallback's pick runs before it), nor count twice what the per-attempt hook judged."""

from __future__ import annotations

import asyncio

import httpx
import litellm
from litellm.types.router import RouterRateLimitError
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings


def hosted(i: int) -> dict:
    return {"model_name": "hosted",
            "litellm_params": {"model": "openai/fake-model", "api_base": f"http://127.0.0.1:{9 + i}/v1",
                               "api_key": "x", "input_cost_per_token": 1e-6 * (i + 1), "output_cost_per_token": 2e-6},
            "model_info": {"id": f"provider-{'ab'[i]}"}}


def callback() -> KvrouteCallback:
    settings = KvrouteSettings(breaker={"consecutive_failures": 1}).check_policies()
    return KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)


def blamed(cb: KvrouteCallback, backend: str) -> float:
    total = 0.0
    for metric in cb.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "kvroute_attempts_total" and s.labels.get("backend") == backend \
                    and s.labels.get("outcome") in ("provider_failure", "capacity", "config_failure"):
                total += s.value
    return total


def server_error() -> Exception:
    response = httpx.Response(500, request=httpx.Request("POST", "http://127.0.0.1:9/v1"))
    return litellm.exceptions.InternalServerError(message="boom", llm_provider="openai", model="m",
                                                  response=response)


def test_no_deployments_event_leaves_the_fallback_ticket_alone():
    cb = callback()
    kwargs: dict = {"litellm_trace_id": "t-1", "metadata": {}}
    picked = cb.filter("hosted", [hosted(0), hosted(1)], [{"role": "user", "content": "x"}], kwargs)
    backend = picked[0]["model_info"]["id"]
    assert len(cb.tickets) == 1
    # the self-hosted group's "No deployments available" arrives after the hosted pick, with shared metadata
    no_deployments = RouterRateLimitError(model="llama", cooldown_time=5, enable_pre_call_checks=False,
                                          cooldown_list=[])
    asyncio.run(cb.async_log_failure_event({**kwargs, "exception": no_deployments}, None, None, None))
    assert len(cb.tickets) == 1  # the hosted attempt is still in flight
    assert cb.health.state(backend, cb.clock()) == "closed" and blamed(cb, backend) == 0


def test_request_event_does_not_recount_what_the_attempt_hook_judged():
    cb = callback()
    kwargs: dict = {"litellm_trace_id": "t-2", "metadata": {}}
    first = cb.filter("hosted", [hosted(0), hosted(1)], [{"role": "user", "content": "y"}], kwargs)[0]
    exc = server_error()
    attempt = {**kwargs, "model_info": first["model_info"]}
    asyncio.run(cb.async_post_call_failure_deployment_hook(attempt, exc, None))
    failed = first["model_info"]["id"]
    assert blamed(cb, failed) == 1 and cb.health.state(failed, cb.clock()) == "open"
    retry = cb.filter("hosted", [hosted(0), hosted(1)], [{"role": "user", "content": "y"}], kwargs)[0]
    assert retry["model_info"]["id"] != failed
    # LiteLLM's request-level event for the first attempt, logged once the retry is already in flight
    asyncio.run(cb.async_log_failure_event({**kwargs, "exception": exc}, None, None, None))
    assert len(cb.tickets) == 1 and blamed(cb, retry["model_info"]["id"]) == 0 and blamed(cb, failed) == 1


def test_request_event_still_judges_an_attempt_no_hook_saw():
    cb = callback()
    kwargs: dict = {"litellm_trace_id": "t-3", "metadata": {}}
    chosen = cb.filter("hosted", [hosted(0), hosted(1)], [{"role": "user", "content": "z"}], kwargs)[0]
    asyncio.run(cb.async_log_failure_event({**kwargs, "exception": server_error()}, None, None, None))
    assert not cb.tickets and blamed(cb, chosen["model_info"]["id"]) == 1


class _Booked:
    """The ledger's side of the hooks, as the statuses each one was handed."""

    def __init__(self) -> None:
        self.statuses: list[tuple[str, str | None]] = []

    def attempt_started(self, attempt, data) -> None:
        pass

    def attempt_failed(self, data, exception, ticket_id=None, *, found=None, status=None) -> None:
        self.statuses.append(("attempt", status))

    def logged_failure(self, kwargs, exception, *, status=None) -> None:
        self.statuses.append(("logged", status))

    def request_failed(self, data, exception, *, status=None) -> None:
        self.statuses.append(("request", status))


def test_one_failure_is_classified_once_through_every_hook(monkeypatch):
    """The attempt's hook, LiteLLM's request-level event and the proxy's final failure hook see the same exception:
    the first classifies it, the other two read its verdict (the ledger's status on every row is that one)."""
    from kvroute.billing import litellm_events
    from kvroute.plugin.adapter import outcomes

    calls: list[BaseException] = []
    real = outcomes.classify

    def counting(exc, **kw):
        calls.append(exc)
        return real(exc, **kw)

    monkeypatch.setattr(outcomes, "classify", counting)
    monkeypatch.setattr(litellm_events, "classify", counting)  # the ledger's own reading of an exception
    cb = callback()
    kwargs: dict = {"litellm_trace_id": "t-9", "metadata": {}}
    chosen = cb.filter("hosted", [hosted(0), hosted(1)], [{"role": "user", "content": "w"}], kwargs)[0]
    cb.billing = booked = _Booked()  # type: ignore[assignment]
    exc = server_error()
    attempt = {**kwargs, "model_info": chosen["model_info"]}
    asyncio.run(cb.async_post_call_failure_deployment_hook(attempt, exc, None))
    asyncio.run(cb.async_log_failure_event({**kwargs, "exception": exc}, None, None, None))
    asyncio.run(cb.async_post_call_failure_hook(kwargs, exc, None))
    assert calls == [exc]
    assert booked.statuses == [("attempt", "provider_failure"), ("logged", "provider_failure"),
                                   ("request", "provider_failure")]
    # a failure no hook judged before (LiteLLM's refusal to route) is classified once, at the end
    refused = RouterRateLimitError(model="hosted", cooldown_time=5, enable_pre_call_checks=False, cooldown_list=[])
    asyncio.run(cb.async_post_call_failure_hook(kwargs, refused, None))
    asyncio.run(cb.async_post_call_failure_hook(kwargs, refused, None))
    assert calls == [exc, refused] and booked.statuses[-2:] == [("request", "no_route")] * 2
