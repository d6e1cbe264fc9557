"""Whom an outcome blames, case by case, through a real LiteLLM proxy (``kvroute.policies.outcomes``).

A backend is charged only when it was called and failed for a reason of its own; everything else (router-level
errors, requests LiteLLM rejects before any upstream call, the request's own 4xx, client disconnects) leaves
every breaker closed and no blaming attempt in ``kvroute_attempts_total``. Neutral cases run first (on a healthy
stack), the blaming ones after; the last one kills a replica.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from outcome_stack import (
    attempts,
    breakers,
    chat,
    clear_faults,
    delta,
    kvroute_proxy,
    send,
    send_stream,
    set_fault,
    stack_config,
    wait_all_closed,
)

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

BLAMING = ("provider_failure", "capacity", "config_failure")
REPLICA_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack():
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        cfg = stack_config(replicas.api_bases, hosted.api_bases, replica_params={"timeout": REPLICA_TIMEOUT_S})
        proxy = es.enter_context(kvroute_proxy(cfg))
        yield {"replicas": replicas, "hosted": hosted, "proxy": proxy,
               "engines": [*replicas.base_urls, *hosted.base_urls]}


async def faults_served(c: httpx.AsyncClient, url: str) -> int:
    return sum((await c.get(url + "/admin/stats")).json()["faults"].values())


def blamed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k[1] in BLAMING}


async def neutral_case(stack, bodies, *, expect_status=None, repeat: int = 5) -> None:
    """Send each body ``repeat`` times (more than ``consecutive_failures``): nobody blamed, all closed, a valid
    request still succeeds."""
    proxy = stack["proxy"]
    assert set((await wait_all_closed(proxy)).values()) == {"closed"}
    before = await attempts(proxy)
    async with httpx.AsyncClient(trust_env=False) as c:
        for i in range(repeat):
            for body in bodies:
                reply = await send(c, proxy, body(i) if callable(body) else body)
                if expect_status is not None:
                    assert reply.status in expect_status, reply
        await asyncio.sleep(0.5)  # the request-level failure events are logged after the reply
        after = await attempts(proxy)
        assert blamed(delta(after, before)) == {}, delta(after, before)
        assert set((await breakers(proxy)).values()) == {"closed"}
        ok = await send(c, proxy, chat("still fine?"))
        assert ok.ok, ok


async def test_requests_litellm_rejects_before_any_upstream_call_blame_nobody(stack):
    bad = [{"model": "llama", "messages": 5, "max_tokens": 2},  # TypeError inside LiteLLM, surfaced as 500
           {"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": "many"}]
    await neutral_case(stack, bad)


async def test_4xx_caused_by_the_request_blames_nobody(stack):
    bad = [chat("x", max_tokens="abc"), chat("x", max_tokens=-5)]  # the engine answers 400
    await neutral_case(stack, bad, expect_status={400})


async def test_router_level_errors_blame_nobody(stack):
    bad = [chat("x", model="no-such-model"), b"{not json", b'{"model": "llama", "messages": ']
    await neutral_case(stack, bad, expect_status={400, 422})
    proxy = stack["proxy"]
    before = await attempts(proxy)
    async with httpx.AsyncClient(trust_env=False) as c:
        for _ in range(5):
            r = await c.post(proxy.base_url + "/v1/chat/completions", json=chat("x"),
                             headers={"Authorization": "Bearer sk-wrong"})
            assert r.status_code in (400, 401), r.text
    assert blamed(delta(await attempts(proxy), before)) == {}


async def test_client_disconnects_blame_nobody(stack):
    replicas = stack["replicas"].base_urls
    proxy = stack["proxy"]
    try:
        for url in replicas:
            await set_fault(url, "slow_first_token", delay_s=1.5)
        assert set((await wait_all_closed(proxy)).values()) == {"closed"}
        before = await attempts(proxy)
        async with httpx.AsyncClient(trust_env=False) as c:
            for i in range(5):
                reply = await send(c, proxy, chat(f"go away {i}"), timeout=0.3)
                assert reply.status == 0  # the client gave up
        await asyncio.sleep(2.5)  # let the abandoned upstream calls finish
        assert blamed(delta(await attempts(proxy), before)) == {}
        assert set((await breakers(proxy)).values()) == {"closed"}
    finally:
        await clear_faults(replicas)


async def test_group_cooldown_no_deployments_error_blames_no_hosted_provider(stack):
    """The measured bug: every replica 500s, LiteLLM cools the group down and raises "No deployments available";
    that error used to be charged to the hosted attempt's ticket and opened provider-a's and provider-b's
    breakers, and clients got 429."""
    proxy = stack["proxy"]
    replicas = stack["replicas"].base_urls
    assert set((await wait_all_closed(proxy)).values()) == {"closed"}
    before = await attempts(proxy)
    try:
        for url in replicas:
            await set_fault(url, "500")
        async with httpx.AsyncClient(trust_env=False) as c:
            replies = [await send(c, proxy, chat(f"cooldown {i} " + "words " * 50)) for i in range(16)]
        await asyncio.sleep(0.5)
        d = delta(await attempts(proxy), before)
        states = await breakers(proxy)
    finally:
        await clear_faults(replicas)
    assert [r.status for r in replies] == [200] * 16, [r.text for r in replies if not r.ok][:2]
    assert {r.backend for r in replies[-8:]} <= {"provider-a", "provider-b"}
    assert not [k for k in blamed(d) if k[0].startswith("provider-")], d
    assert states["provider-a"] == states["provider-b"] == "closed", states
    assert sum(v for k, v in d.items() if k[0].startswith("llama-") and k[1] == "provider_failure") >= 2, d


async def test_a_backends_5xx_blames_that_backend_only(stack):
    proxy = stack["proxy"]
    replicas = stack["replicas"].base_urls
    await wait_all_closed(proxy)
    before = await attempts(proxy)
    try:
        await set_fault(replicas[0], "500")
        async with httpx.AsyncClient(trust_env=False) as c:
            served = await faults_served(c, replicas[0])
            replies = []
            for i in range(40):  # until the router has tried llama-0 twice (it may be cooling down in LiteLLM)
                replies.append(await send(c, proxy, chat(f"five hundred {i} " + "w " * 40)))
                if (await faults_served(c, replicas[0])) >= served + 2:
                    break
                await asyncio.sleep(0.2)
    finally:
        await clear_faults(replicas)
    d = blamed(delta(await attempts(proxy), before))
    assert all(r.ok for r in replies), [r.text for r in replies if not r.ok][:2]
    assert d.get(("llama-0", "provider_failure"), 0) >= 1 and set(d) == {("llama-0", "provider_failure")}, d


async def test_a_providers_429_blames_it_as_capacity_for_its_retry_after(stack):
    proxy = stack["proxy"]
    hosted = stack["hosted"].base_urls
    await wait_all_closed(proxy)
    before = await attempts(proxy)
    try:
        await set_fault(hosted[0], "429", retry_after=8)
        async with httpx.AsyncClient(trust_env=False) as c:
            replies = [await send(c, proxy, chat(f"rate {i}", model="hosted")) for i in range(4)]
            states = await breakers(proxy)
    finally:
        await clear_faults(hosted)
    d = blamed(delta(await attempts(proxy), before))
    assert all(r.ok for r in replies), [r.text for r in replies if not r.ok][:2]
    assert set(d) == {("provider-a", "capacity")}, d
    assert states["provider-a"] == "open" and states["provider-b"] == "closed", states


async def test_a_slow_first_token_past_the_timeout_blames_the_backend(stack):
    proxy = stack["proxy"]
    replicas = stack["replicas"].base_urls
    await wait_all_closed(proxy)
    before = await attempts(proxy)
    try:
        await set_fault(replicas[1], "slow_first_token", delay_s=REPLICA_TIMEOUT_S + 3)
        async with httpx.AsyncClient(trust_env=False) as c:
            replies = [await send(c, proxy, chat(f"slow {i} " + "s " * 40), timeout=60) for i in range(6)]
    finally:
        await clear_faults(replicas)
    d = blamed(delta(await attempts(proxy), before))
    assert all(r.ok for r in replies), [r.text for r in replies if not r.ok][:2]
    assert set(d) == {("llama-1", "provider_failure")}, d


async def test_a_stream_cut_by_the_backend_blames_it(stack):
    proxy = stack["proxy"]
    replicas = stack["replicas"].base_urls
    await wait_all_closed(proxy)
    before = await attempts(proxy)
    try:
        await set_fault(replicas[0], "cut", cut_after_chunks=1)
        async with httpx.AsyncClient(trust_env=False) as c:
            for i in range(8):
                await send_stream(c, proxy, chat(f"cut {i} " + "c " * 40, max_tokens=8))
        await asyncio.sleep(0.5)
    finally:
        await clear_faults(replicas)
    d = blamed(delta(await attempts(proxy), before))
    assert set(d) == {("llama-0", "provider_failure")}, d


async def test_a_connect_error_blames_the_dead_replica(stack):
    proxy = stack["proxy"]
    await wait_all_closed(proxy)
    before = await attempts(proxy)
    stack["replicas"].kill(0)
    async with httpx.AsyncClient(trust_env=False) as c:
        replies = [await send(c, proxy, chat(f"dead {i} " + "d " * 40)) for i in range(8)]
    d = blamed(delta(await attempts(proxy), before))
    assert all(r.ok for r in replies), [r.text for r in replies if not r.ok][:2]
    assert set(d) == {("llama-0", "provider_failure")}, d
