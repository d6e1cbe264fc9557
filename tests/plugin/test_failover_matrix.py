"""Failover matrix through a real proxy: a self-hosted group (3 fake replicas) with a hosted fallback group
(2 providers), kvroute's breakers with shared state in Redis and without.

Each scenario injects a fault while two clients send requests, measures the seconds until traffic has shifted
away (the faulty backends' breakers open, or the first hosted answer for LiteLLM's own group cooldown) and,
after the fault is cleared, back (a half-open probe succeeded and a formerly faulty backend served a request).
While a healthy route exists no client may see a failure. Figures are printed; bounds are generous (a busy
2-core box), never tight wall-clock asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx
import pytest
from outcome_stack import (
    Reply,
    breakers,
    chat,
    clear_faults,
    kvroute_proxy,
    send,
    send_stream,
    set_fault,
    stack_config,
    wait_all_closed,
)

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

REPLICA_TIMEOUT_S = 2.0
SHIFT_BOUND_S = 30.0
RECOVER_BOUND_S = 60.0
FIGURES: list[str] = []


@pytest.fixture(scope="module", params=["local", "redis"])
def stack(request):
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=1.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(3, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        # a stream cut after text was delivered continues elsewhere by assistant prefill (LiteLLM's own
        # mechanism; it needs deployments that declare prefill support, as the fake engines do)
        cfg = stack_config(replicas.api_bases, hosted.api_bases, replica_params={"timeout": REPLICA_TIMEOUT_S},
                           router={"enable_mid_stream_fallback_continuation": True})
        for dep in cfg["model_list"]:
            dep["model_info"]["supports_assistant_prefill"] = True
        proxy = es.enter_context(kvroute_proxy(cfg, redis_url))
        yield {"mode": request.param, "replicas": replicas, "hosted": hosted, "proxy": proxy}
        print("\nfailover matrix figures:\n  " + "\n  ".join(FIGURES))


async def drive(proxy, stop: asyncio.Event, replies: list[tuple[float, Reply]], tag: str, stream: bool) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        i = 0
        while not stop.is_set():
            body = chat(f"matrix {tag} {i} " + "m " * 30, max_tokens=4)
            at = time.monotonic()
            reply = await (send_stream(c, proxy, body, timeout=60) if stream else send(c, proxy, body, timeout=60))
            replies.append((at, reply))
            i += 1
            await asyncio.sleep(0.05)


async def run_scenario(stack, name: str, faulty_urls: Sequence[str], faulty_ids: Sequence[str],
                       inject: Callable[[], Awaitable[None]], *, stream: bool = False,
                       shifted: str = "breakers") -> tuple[float, float]:
    """Inject, wait for the shift, keep traffic on the healthy route for 2 s, clear, wait for the way back."""
    proxy = stack["proxy"]
    assert set((await wait_all_closed(proxy)).values()) == {"closed"}
    await asyncio.sleep(REPLICA_TIMEOUT_S + 1.5)  # LiteLLM's own cooldowns from the probes are over
    replies: list[tuple[float, Reply]] = []
    stop = asyncio.Event()
    drivers = [asyncio.create_task(drive(proxy, stop, replies, f"{name}-{stack['mode']}-{k}", stream))
               for k in range(2)]
    shift = back = None
    try:
        t0 = time.monotonic()
        await inject()
        while time.monotonic() - t0 < SHIFT_BOUND_S:
            if shifted == "breakers":
                states = await breakers(proxy)
                done = all(states.get(b) == "open" for b in faulty_ids)
            else:  # LiteLLM's group cooldown: the first answer from the fallback group
                done = any(r.ok and (r.backend or "").startswith("provider-") for t, r in replies if t >= t0)
            if done:
                shift = time.monotonic() - t0
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)
        t1 = time.monotonic()
        await clear_faults(faulty_urls)
        while shift is not None and time.monotonic() - t1 < RECOVER_BOUND_S:
            states = await breakers(proxy)
            served = any(r.ok and r.backend in faulty_ids for t, r in replies if t >= t1)
            if served and all(states.get(b) == "closed" for b in faulty_ids):
                back = time.monotonic() - t1
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*drivers, return_exceptions=True)
        await clear_faults(faulty_urls)
    failures = [r for _, r in replies if not r.ok]
    by = {}
    for _, r in replies:
        by[r.backend] = by.get(r.backend, 0) + 1
    line = (f"{stack['mode']:5} {name:22} requests {len(replies):4}  client failures {len(failures)}  "
            f"shift {'-' if shift is None else f'{shift:.1f}'} s  back {'-' if back is None else f'{back:.1f}'} s"
            f"  served by {dict(sorted(by.items(), key=str))}")
    FIGURES.append(line)
    print("\n" + line)
    assert failures == [], [r.text[:200] for r in failures[:3]]
    assert shift is not None, f"{name}: traffic did not shift away within {SHIFT_BOUND_S:g} s"
    assert back is not None, f"{name}: traffic did not come back within {RECOVER_BOUND_S:g} s"
    return shift, back


def _ids(indices: Sequence[int]) -> list[str]:
    return [f"llama-{i}" for i in indices]


async def test_all_replicas_500(stack):
    urls = stack["replicas"].base_urls

    async def inject():
        await asyncio.gather(*(set_fault(u, "500") for u in urls))

    await run_scenario(stack, "all replicas 500", urls, _ids(range(3)), inject)


async def test_429_storm_with_retry_after(stack):
    urls = stack["replicas"].base_urls

    async def inject():
        await asyncio.gather(*(set_fault(u, "429", retry_after=4) for u in urls))

    await run_scenario(stack, "429 storm, Retry-After 4", urls, _ids(range(3)), inject)


async def test_one_replica_slow_first_token(stack):
    url = stack["replicas"].base_urls[1]

    async def inject():
        await set_fault(url, "slow_first_token", delay_s=REPLICA_TIMEOUT_S * 2)

    await run_scenario(stack, "one slow first token", [url], _ids([1]), inject, stream=True)


async def test_mid_stream_cuts(stack):
    url = stack["replicas"].base_urls[2]

    async def inject():
        await set_fault(url, "cut", cut_after_chunks=2)

    await run_scenario(stack, "mid-stream cuts", [url], _ids([2]), inject, stream=True)


async def test_litellm_group_cooldown(stack):
    """Each replica fails twice (under kvroute's 3 consecutive failures): LiteLLM cools the whole group down
    and raises "No deployments available"; the hosted group serves, and no hosted breaker opens."""
    urls = stack["replicas"].base_urls

    async def inject():
        await asyncio.gather(*(set_fault(u, "500", count=2) for u in urls))

    await run_scenario(stack, "LiteLLM group cooldown", urls, _ids(range(3)), inject, shifted="first_hosted")
    states = await breakers(stack["proxy"])
    assert states["provider-a"] == states["provider-b"] == "closed", states
