"""One table of cases: exception chain (as LiteLLM 1.110.2 raises them, by class name) → whom it blames."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvroute.policies.health import Outcome
from kvroute.policies.outcomes import Attribution, FailureKind, classify, retry_after_of


def _cls(name: str, module: str = "litellm.exceptions") -> type[Exception]:
    return type(name, (Exception,), {"__module__": module})


class _Response:
    def __init__(self, status: int, headers: dict | None = None) -> None:
        self.status_code = status
        self.headers = headers or {}


def err(name: str, msg: str = "", module: str = "litellm.exceptions", status: int | None = None,
        response: _Response | None = None) -> Exception:
    exc = _cls(name, module)(msg)
    if status is not None:
        exc.status_code = status
    if response is not None:
        exc.response = response
    return exc


def chain(*links: BaseException) -> BaseException:
    """``chain(top, cause, root)``: each link raised from the next one, as LiteLLM wraps errors."""
    for outer, inner in itertools.pairwise(links):
        outer.__cause__ = inner
    return links[0]


def upstream(status: int, top: str, headers: dict | None = None) -> BaseException:
    """What LiteLLM raises when the backend answered ``status``."""
    resp = _Response(status, headers)
    return chain(err(top, "OpenAIException - boom", status=status, response=resp),
                 err("OpenAIError", module="litellm.llms.openai.common_utils", status=status),
                 err(top, module="openai", status=status, response=resp),
                 err("HTTPStatusError", module="httpx", response=resp))


def transport(top: str, *inner: tuple[str, str]) -> BaseException:
    fake = _Response(500)  # LiteLLM invents a 500 response for connection failures
    return chain(err(top, "OpenAIException - Connection error.", status=500, response=fake),
                 *(err(name, module=module) for name, module in inner))


CASES = [
    # (case, exception, kind, blames backend)
    ("backend 500", upstream(500, "InternalServerError"), FailureKind.BACKEND_ERROR, True),
    ("backend 502", upstream(502, "APIError"), FailureKind.BACKEND_ERROR, True),
    ("backend 429 + Retry-After", upstream(429, "RateLimitError", {"retry-after": "3"}), FailureKind.CAPACITY, True),
    ("backend 503 + Retry-After", upstream(503, "ServiceUnavailableError", {"retry-after": "2"}),
     FailureKind.CAPACITY, True),
    ("backend 401", upstream(401, "AuthenticationError"), FailureKind.BACKEND_CONFIG, True),
    ("backend 404", upstream(404, "NotFoundError"), FailureKind.BACKEND_CONFIG, True),
    ("backend 408", upstream(408, "Timeout"), FailureKind.TIMEOUT, True),
    ("backend 400 (request's fault)", upstream(400, "BadRequestError"), FailureKind.REQUEST_INVALID, False),
    ("backend 422", upstream(422, "UnprocessableEntityError"), FailureKind.REQUEST_INVALID, False),
    ("connection refused", transport("InternalServerError", ("APIConnectionError", "openai"),
                                     ("ConnectError", "httpx"), ("ClientConnectorError", "aiohttp.client_exceptions"),
                                     ("ConnectionRefusedError", "builtins")), FailureKind.CONNECT_ERROR, True),
    ("connection dropped", transport("APIConnectionError", ("ReadError", "httpx")), FailureKind.CONNECT_ERROR, True),
    ("pooled connection reset (seen on llama.cpp)", transport(
        "InternalServerError", ("OpenAIError", "litellm.llms.openai.common_utils"), ("APIConnectionError", "openai"),
        ("ReadError", "httpx"), ("ClientOSError", "aiohttp.client_exceptions"),
        ("ClientConnectionResetError", "aiohttp.client_exceptions")), FailureKind.CONNECTION_LOST, True),
    ("server closed the connection before answering", transport(
        "APIConnectionError", ("ReadError", "httpx"), ("ServerDisconnectedError", "aiohttp.client_exceptions")),
     FailureKind.CONNECTION_LOST, True),
    ("reset while connecting is a new connection's failure", transport(
        "APIConnectionError", ("ClientConnectorError", "aiohttp.client_exceptions"),
        ("ConnectionResetError", "builtins")), FailureKind.CONNECT_ERROR, True),
    ("read timeout", transport("Timeout", ("APITimeoutError", "openai"), ("ReadTimeout", "httpx")),
     FailureKind.SLOW_FIRST_TOKEN, True),
    ("connect timeout", transport("Timeout", ("ConnectTimeout", "httpx")), FailureKind.TIMEOUT, True),
    ("stream cut", transport("APIConnectionError", ("RemoteProtocolError", "httpx")), FailureKind.STREAM_CUT, True),
    ("no deployments (cooldown)", err("RouterRateLimitError", "No deployments available for selected model, "
                                      "Try again in 5 seconds. Passed model=llama", "litellm.types.router", 429),
     FailureKind.ROUTER, False),
    ("upstream 429 whose text says no deployments", chain(
        err("RateLimitError", "No deployments available for selected model", status=429),
        err("HTTPStatusError", "No deployments available", module="httpx", response=_Response(429))),
     FailureKind.CAPACITY, True),
    ("budget exceeded", err("BudgetExceededError", "Budget has been exceeded", status=400), FailureKind.ROUTER,
     False),
    ("global budget spent (SDK wrapper, after the pick)", err(
        "BudgetExceededError", "Budget has been exceeded! Current cost: 0.0, Max budget: -1.0", status=422),
     FailureKind.ROUTER, False),
    ("deployment/provider budget filter", ValueError(
        "No deployments available - crossed budget: Exceeded budget for provider openai: 3.3e-05 >= 3e-05"),
     FailureKind.ROUTER, False),
    ("budget filter error wrapped by LiteLLM", chain(
        err("APIConnectionError", "No deployments available - crossed budget: Exceeded budget for deployment "
            "model_name: hosted, model_id: provider-a", status=500),
        ValueError("No deployments available - crossed budget")), FailureKind.ROUTER, False),
    ("key budget at the proxy", err("ProxyException", "Budget has been exceeded! Key=key Current cost: 2.0, "
                                    "Max budget: 1.0", "litellm.proxy._types", 400), FailureKind.ROUTER, False),
    ("proxy auth", err("ProxyException", "Authentication Error, invalid key", "litellm.proxy._types", 401),
     FailureKind.ROUTER, False),
    ("unknown model", err("ProxyModelNotFoundError", "Invalid model name passed in model=x",
                          "litellm.proxy.route_llm_request", 400), FailureKind.ROUTER, False),
    ("pre-call TypeError", chain(err("APIConnectionError", "OpenAIException - 'int' object is not iterable",
                                     status=500), TypeError("'int' object is not iterable")),
     FailureKind.REQUEST_REJECTED, False),
    ("pre-call ValueError", chain(err("APIConnectionError", "bad", status=500), ValueError("bad")),
     FailureKind.REQUEST_REJECTED, False),
    ("validation as 400 APIConnectionError", err("APIConnectionError", "invalid content", status=400),
     FailureKind.REQUEST_REJECTED, False),
    ("cancelled", asyncio.CancelledError(), FailureKind.CANCELLED, False),
    ("client disconnect 499", err("ClientDisconnect", module="starlette.requests"), FailureKind.CANCELLED, False),
    ("bare 500 wrapper without chain", err("InternalServerError", "boom", status=500), FailureKind.BACKEND_ERROR,
     True),
    ("bare rate limit", err("RateLimitError", "slow down"), FailureKind.CAPACITY, True),
    ("bare timeout", err("Timeout", "t"), FailureKind.TIMEOUT, True),
    ("bare connection error", err("APIConnectionError", "Connection error."), FailureKind.BACKEND_ERROR, True),
]


@pytest.mark.parametrize(("case", "exc", "kind", "blames"), CASES, ids=[c[0] for c in CASES])
def test_attribution_table(case, exc, kind, blames):
    got = classify(exc, backend_called=True)
    assert (got.kind, got.blames_backend) == (kind, blames), case
    assert (got.outcome in (Outcome.CLIENT_ERROR, Outcome.CANCELLED)) is not blames  # neutral for the breaker


@pytest.mark.parametrize(("case", "exc", "kind", "blames"), CASES, ids=[c[0] for c in CASES])
def test_nothing_blames_a_backend_that_was_not_called(case, exc, kind, blames):
    got = classify(exc, backend_called=False)
    assert got.kind is kind and not got.blames_backend and got.retry_after_s is None


def test_breaker_outcomes_and_retry_after():
    cap = classify(upstream(429, "RateLimitError", {"retry-after": "3"}))
    assert cap.outcome is Outcome.CAPACITY and cap.retry_after_s == 3.0 and cap.status == 429
    assert classify(upstream(401, "AuthenticationError")).outcome is Outcome.CONFIG_FAILURE
    assert classify(upstream(500, "InternalServerError")).outcome is Outcome.PROVIDER_FAILURE
    assert classify(asyncio.CancelledError()).outcome is Outcome.CANCELLED
    assert classify(upstream(400, "BadRequestError")).outcome is Outcome.CLIENT_ERROR
    assert retry_after_of(upstream(429, "RateLimitError", {"retry-after": "soon"})) is None
    assert retry_after_of(upstream(429, "RateLimitError", {"retry-after": "inf"})) is None


def test_a_cut_after_the_first_token_keeps_the_prefill():
    cut = classify(transport("APIConnectionError", ("ReadTimeout", "httpx")), first_token=True)
    assert cut.kind is FailureKind.STREAM_CUT and cut.blames_backend and not cut.before_prefill
    assert classify(upstream(500, "InternalServerError")).before_prefill


def test_no_exception_and_cycles():
    assert classify(None) == Attribution(FailureKind.BACKEND_ERROR, True)
    assert not classify(None, backend_called=False).blames_backend
    a, b = err("InternalServerError", status=500), err("HTTPStatusError", module="httpx", status=500)
    a.__cause__, b.__context__ = b, a  # a cycle must not loop
    assert classify(a).kind is FailureKind.BACKEND_ERROR
