"""Differential fuzz: generated malformed and odd requests sent to a proxy with kvroute and one without (same
fake engines, same LiteLLM settings, kvroute's breakers on with their defaults). kvroute must not change any
request's status class, and no kvroute frame may appear in a traceback in the proxy log.

``KVROUTE_FUZZ_CASES`` (default 10 000) and ``KVROUTE_FUZZ_SEED`` pick the cases; each case goes to both proxies
at the same moment so both see the engines in the same state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fuzz_requests import Case, generate
from outcome_stack import kvroute_proxy, plain_proxy, stack_config

import kvroute.billing
import kvroute.plugin
import kvroute.policies
from kvroute.plugin.dev.fake_engine import FakeEngineConfig, FakeEngineServer
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

CASES = int(os.environ.get("KVROUTE_FUZZ_CASES", "10000"))
SEED = int(os.environ.get("KVROUTE_FUZZ_SEED", "20261201"))
CONCURRENCY = 12
_PLUGIN_ERRORS = re.compile(r'^kvroute_plugin_errors_total\{hook="([^"]*)"\} (\S+)$', re.M)


async def status_of(c: httpx.AsyncClient, proxy: ProxyProcess, case: Case) -> int:
    """The status the client saw: 0 for a transport error, 599 for a stream that broke or carried an error."""
    headers = {"content-type": "application/json", **proxy.headers,
               **{k: v.encode("latin-1") for k, v in case.headers.items()}}
    url = proxy.base_url + "/v1/chat/completions"
    try:
        if not case.stream:
            return (await c.post(url, content=case.content(), headers=headers, timeout=60)).status_code
        async with c.stream("POST", url, content=case.content(), headers=headers, timeout=60) as r:
            text = "".join([t async for t in r.aiter_text()])
            if r.status_code == 200 and ("[DONE]" not in text or '"error"' in text):
                return 599
            return r.status_code
    except httpx.HTTPError:
        return 0


#: where kvroute's code lives in this environment (an editable install's folders or site-packages/kvroute)
_OURS = tuple(str(Path(m.__file__).parent) + os.sep for m in (kvroute.plugin, kvroute.policies, kvroute.billing))


def kvroute_tracebacks(log: str) -> list[str]:
    """Tracebacks with a frame in kvroute's code (a log line of ours printed right after LiteLLM's own traceback
    does not make it ours)."""
    blocks = re.split(r"(?=Traceback \(most recent call last\))", log)
    return [b[:1500] for b in blocks[1:]
            if any(f.startswith(_OURS) for f in re.findall(r'File "([^"]+)"', b.split("\n\n", 1)[0]))]


async def test_fake_engine_bounds_max_tokens():
    config = FakeEngineConfig(max_tokens_limit=64, prefill_tokens_per_s=1e6, decode_s_per_token=0)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as c:
        body = {"messages": [{"role": "user", "content": "x"}]}
        ok = await c.post("/v1/chat/completions", json={**body, "max_tokens": 64})
        big = await c.post("/v1/chat/completions", json={**body, "max_tokens": 65})
        flag = await c.post("/v1/chat/completions", json={**body, "max_tokens": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 64
    assert big.status_code == 400 and big.json()["error"]["message"] == "max_tokens must be <= 64"
    assert flag.status_code == 400
    with pytest.raises(Exception, match="max_tokens_limit"):
        FakeEngineConfig(max_tokens_limit=8, default_max_tokens=16)


async def test_kvroute_changes_no_status_class_of_odd_requests():
    # fast engines (no attention term): the fuzz is about request shapes, so no odd request may time out for slowness
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=10**6, decode_ms=0.0, slots=16,
                          extra_args=("--context-cost", "0"))
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        # LiteLLM's own cooldowns are off in both proxies: they would turn bad requests into timing-dependent
        # "No deployments available" 429s on either side; kvroute's breakers stay on, with their defaults.
        router = {"disable_cooldowns": True}
        ours = es.enter_context(kvroute_proxy(stack_config(replicas.api_bases, hosted.api_bases, router=router),
                                              breaker={}))
        plain = es.enter_context(plain_proxy(stack_config(replicas.api_bases, hosted.api_bases, kvroute=False,
                                                          router=router)))
        cases = generate(CASES, SEED)
        results: dict[int, tuple[int, int]] = {}
        gate = asyncio.Semaphore(CONCURRENCY)
        began = time.monotonic()
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        async with httpx.AsyncClient(trust_env=False, limits=limits) as c_ours, \
                httpx.AsyncClient(trust_env=False, limits=limits) as c_plain:

            async def one(case: Case) -> None:
                async with gate:
                    a, b = await asyncio.gather(status_of(c_ours, ours, case), status_of(c_plain, plain, case))
                    results[case.index] = (a, b)

            await asyncio.gather(*(one(case) for case in cases))
            metrics = (await c_ours.get(ours.base_url + "/kvroute/metrics", headers=ours.headers)).text
        elapsed = time.monotonic() - began
        log = ours.log_text()
    classes = Counter((a // 100, b // 100) for a, b in results.values())
    differ = {i: r for i, r in results.items() if r[0] // 100 != r[1] // 100}
    plugin_errors = {hook: float(v) for hook, v in _PLUGIN_ERRORS.findall(metrics) if float(v)}
    print(f"\nfuzz differential: {len(results)} cases (seed {SEED}, {sum(c.stream for c in cases)} streamed) in "
          f"{elapsed:.0f} s; status classes (kvroute, plain): {dict(sorted(classes.items()))}; "
          f"differ: {len(differ)}; kvroute plugin errors (swallowed): {plugin_errors}")
    for i, (a, b) in list(differ.items())[:10]:
        print(f"  case {i}: kvroute {a} vs plain {b}: {cases[i].content()[:200]!r} headers={cases[i].headers}")
    if differ:  # what opened: kvroute's attempt outcomes other than success, and breaker transitions
        print("\n".join(ln for ln in metrics.splitlines() if ln.startswith(("kvroute_attempts_total",
              "kvroute_breaker_transitions_total")) and 'outcome="success"' not in ln))
    assert len(results) == CASES
    assert differ == {}, f"{len(differ)} cases differ"
    assert kvroute_tracebacks(log) == [], kvroute_tracebacks(log)[:3]


async def test_fake_engine_answers_odd_bodies_with_4xx_not_5xx():
    """An engine's 5xx blames it: the fake engine must not answer a malformed request with one (vLLM gives 400)."""
    config = FakeEngineConfig(prefill_tokens_per_s=1e6, decode_s_per_token=0)
    odd = [b'{"messages": [{"role": "user", "content": [{"type": "text", "text": {"x": 1}}]}]}',
           b'{"messages": [{"role": "user", "content": 2.5}]}',
           b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"]
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as c:
        statuses = [(await c.post("/v1/chat/completions", content=body)).status_code for body in odd]
        lone = await c.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}],'
                                                             b' "stream": true, "stream_options": "yes"}')
    assert statuses == [400, 400, 400]
    assert lone.status_code == 200 and "[DONE]" in lone.text
