"""The fake replica: prefix cache (blocks, chain hashes, LRU), OpenAI wire format, streaming, faults, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.plugin.dev.fake_cache import PrefixCache, block_keys, token_count
from kvroute.plugin.dev.fake_engine import FakeEngineConfig, FakeEngineServer, render_chat
from kvroute.plugin.dev.fake_faults import FaultPlan
from kvroute.policies.errors import ConfigError

DOC = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(60))  # ~3.1k bytes


# ---------------------------------------------------------------------------------------------- cache model
def test_block_keys_are_chained():
    a = block_keys("x" * 64 + "A" * 64 + "C" * 64, 16)
    b = block_keys("x" * 64 + "B" * 64 + "C" * 64, 16)
    assert len(a) == len(b) == 3
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # same third block, different history


def test_lookup_counts_leading_full_blocks_only():
    cache = PrefixCache(capacity_tokens=1024, block_tokens=16)
    prompt = DOC[:800]  # 200 tokens
    assert cache.lookup(prompt) == 0
    cache.insert(prompt)
    assert cache.lookup(prompt) == 192  # full blocks of the first 199 tokens
    assert cache.lookup(prompt[:400] + "different tail " * 20) == 96  # 100 shared tokens -> 6 blocks
    assert cache.lookup("something else entirely" * 10) == 0
    assert cache.queries == 4 and cache.hit_tokens == 192 + 96


def test_lru_evicts_least_recent_prefix_deepest_blocks_first():
    cache = PrefixCache(capacity_tokens=4 * 16, block_tokens=16)  # 4 blocks
    a, b = "a" * 128, "b" * 128  # 32 tokens = 2 blocks each
    cache.insert(a)
    cache.insert(b)
    cache.lookup(a) and cache.insert(a)  # touch a
    cache.insert("c" * 64)  # 1 block: evicts b's deepest block, not its first
    assert cache.match(block_keys(a, 16)) == 2
    assert cache.match(block_keys(b, 16)) == 1
    assert cache.evicted_blocks == 1
    assert cache.used_tokens == 64 and cache.usage == 1.0


def test_zero_capacity_caches_nothing():
    cache = PrefixCache(capacity_tokens=0)
    cache.insert(DOC)
    assert cache.lookup(DOC) == 0


@given(st.text(min_size=0, max_size=600), st.text(max_size=200), st.integers(1, 32), st.integers(0, 4096))
def test_cached_tokens_invariants(prefix, suffix, block, capacity):
    cache = PrefixCache(capacity_tokens=capacity, block_tokens=block)
    cache.insert(prefix)
    prompt = prefix + suffix
    cached = cache.lookup(prompt)
    assert cached % block == 0
    assert 0 <= cached <= max(token_count(prompt) - 1, 0)
    assert cache.used_tokens <= cache.capacity_tokens
    if capacity >= token_count(prefix) + block and suffix:
        shared = len(prefix.encode()) // 4
        assert cached >= min(shared, token_count(prompt) - 1) // block * block


def test_render_chat_rejects_bad_messages():
    assert render_chat([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    assert render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}]}]).startswith("<|user|>\na")
    with pytest.raises(ValueError):
        render_chat([])


def test_fault_plan_counts_down_and_validates():
    plan = FaultPlan.parse({"mode": "500", "count": 2})
    assert plan.take().mode == "500" and plan.take().mode == "500"
    assert plan.take() is None
    with pytest.raises(ConfigError, match=r"fault\.mode"):
        FaultPlan.parse({"mode": "explode"})
    with pytest.raises(ConfigError, match=r"fault\.count"):
        FaultPlan.parse({"mode": "500", "count": 0})
    with pytest.raises(ConfigError, match=r"fault\.retry_after"):
        FaultPlan.parse({"mode": "429", "retry_after": -1})
    with pytest.raises(ConfigError, match="capacity_tokens"):
        FakeEngineConfig(capacity_tokens=-1)


# ---------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture
async def engine():
    config = FakeEngineConfig(name="t0", capacity_tokens=4096, prefill_tokens_per_s=200_000, decode_s_per_token=0)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
        yield server, client


def chat(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": content}],
            "max_tokens": 4, **extra}


async def test_repeated_prefix_reports_cached_tokens(engine):
    _, client = engine
    first = (await client.post("/v1/chat/completions", json=chat("one"))).json()
    second = (await client.post("/v1/chat/completions", json=chat("two"),
                                headers={"authorization": "Bearer secret"})).json()
    assert first["object"] == "chat.completion" and first["choices"][0]["message"]["role"] == "assistant"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["completion_tokens"] == 4
    prompt = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and prompt - 32 < cached < prompt
    stats = (await client.get("/admin/stats")).json()
    assert stats["cached_tokens"] == cached and stats["succeeded"] == 2
    assert stats["last_request"]["body_keys"] == ["max_tokens", "messages", "model"]
    assert stats["last_request"]["headers"]["authorization"] == "<redacted>"
    assert "quick brown fox" not in json.dumps(stats)  # never prompt text


async def test_cache_salt_separates_prefixes_like_vllm(engine):
    _, client = engine

    async def cached(**extra) -> int:
        body = (await client.post("/v1/chat/completions", json=chat("same question", **extra))).json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(cache_salt="tenant-a") == 0
    assert await cached(cache_salt="tenant-a") > 0  # same salt: shared
    assert await cached(cache_salt="tenant-b") == 0  # another salt reaches nothing of tenant-a's
    assert await cached() == 0  # nor does the unsalted prompt


async def test_prefill_time_scales_with_uncached_tokens():
    config = FakeEngineConfig(capacity_tokens=8192, prefill_tokens_per_s=1_000_000)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as client:
        await client.post("/v1/chat/completions", json=chat("a"))
        cold = server.engine.stats.prefill_seconds
        await client.post("/v1/chat/completions", json=chat("b"))
        warm = server.engine.stats.prefill_seconds - cold
    assert warm < 0.05 * cold


async def test_multi_turn_reuses_the_previous_answer(engine):
    _, client = engine
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "q1"}]
    r1 = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 64})).json()
    messages += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "q2"}]
    r2 = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})).json()
    # the whole first turn, the answer included, is cached (up to block granularity)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"] + 64 - 32


async def _sse(client: httpx.AsyncClient, path: str, body: dict) -> list:
    events = []
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


async def test_streaming_chat_with_and_without_usage(engine):
    _, client = engine
    events = await _sse(client, "/v1/chat/completions", chat("s", stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text) == 16  # 4 tokens of 4 bytes
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    plain = [json.loads(e) for e in (await _sse(client, "/v1/chat/completions", chat("s", stream=True)))[:-1]]
    assert all("usage" not in c for c in plain)


async def test_text_completions_json_and_stream(engine):
    _, client = engine
    body = {"model": "m", "prompt": DOC, "max_tokens": 3}
    r = (await client.post("/v1/completions", json=body)).json()
    assert r["object"] == "text_completion" and len(r["choices"][0]["text"]) == 12
    events = await _sse(client, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    last = json.loads(events[-2])
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_models_health_metrics_and_bad_requests(engine):
    _, client = engine
    assert (await client.get("/health")).json()["status"] == "ok"
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake-model"
    await client.post("/v1/chat/completions", json=chat("m"))
    await client.post("/v1/chat/completions", json=chat("m"))
    metrics = (await client.get("/metrics")).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if not line.startswith("#")}
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:prompt_tokens_cached_total"] > 0
    assert values["vllm:prefix_cache_hits_total"] <= values["vllm:prefix_cache_queries_total"]
    assert values["vllm:kv_cache_usage_perc"] == 0  # vLLM semantics: cached blocks at rest are evictable, not used
    assert (await client.post("/v1/chat/completions", content=b"{not json")).status_code == 400
    bad = await client.post("/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    assert (await client.get("/nope")).status_code == 404


async def test_llamacpp_style_metrics_and_timings():
    async with FakeEngineServer(FakeEngineConfig(metrics_style="llamacpp")) as server, \
            httpx.AsyncClient(base_url=server.base_url) as client:
        await client.post("/v1/chat/completions", json=chat("a"))
        r = (await client.post("/v1/chat/completions", json=chat("b"))).json()
        text = (await client.get("/metrics")).text
    assert r["timings"]["cache_n"] == r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert r["timings"]["prompt_n"] == r["usage"]["prompt_tokens"] - r["timings"]["cache_n"]
    assert "llamacpp:prompt_tokens_cached_total" in text and "llamacpp:requests_deferred" in text


async def test_fault_500_for_n_requests_then_recovers(engine):
    _, client = engine
    r = await client.post("/admin/fault", json={"mode": "500", "count": 2})
    assert r.json()["fault"]["remaining"] == 2
    codes = [(await client.post("/v1/chat/completions", json=chat("x"))).status_code for _ in range(3)]
    assert codes == [500, 500, 200]
    assert (await client.get("/admin/stats")).json()["faults"] == {"500": 2}


async def test_fault_429_carries_retry_after_until_cleared(engine):
    _, client = engine
    await client.post("/admin/fault", json={"mode": "429", "retry_after": 7})
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
    await client.delete("/admin/fault")
    assert (await client.post("/v1/chat/completions", json=chat("x"))).status_code == 200
    bad = await client.post("/admin/fault", json={"mode": "explode"})
    assert bad.status_code == 400 and "fault.mode" in bad.json()["error"]["message"]


async def test_fault_drop_closes_without_a_response(engine):
    _, client = engine
    await client.post("/admin/fault", json={"mode": "drop", "count": 1})
    with pytest.raises(httpx.TransportError):
        await client.post("/v1/chat/completions", json=chat("x"))
    assert (await client.post("/v1/chat/completions", json=chat("x"))).status_code == 200


async def test_fault_cut_mid_stream(engine):
    _, client = engine
    await client.post("/admin/fault", json={"mode": "cut", "count": 2, "cut_after_chunks": 2})
    got = []
    with pytest.raises(httpx.TransportError):
        async with client.stream("POST", "/v1/chat/completions", json=chat("x", stream=True)) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    got.append(line)
    assert 1 <= len(got) <= 2 and "[DONE]" not in "".join(got)
    with pytest.raises(httpx.TransportError):  # non-streaming: the body is cut short
        await client.post("/v1/chat/completions", json=chat("x"))
    stats = (await client.get("/admin/stats")).json()
    assert stats["faults"] == {"cut": 2} and stats["succeeded"] == 0


async def test_fault_slow_first_token(engine):
    _, client = engine
    await client.post("/admin/fault", json={"mode": "slow_first_token", "delay_s": 0.3, "count": 1})
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=chat("x", stream=True)) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                break
    assert time.perf_counter() - start >= 0.3  # a lower bound set by the fault itself, not a performance claim


async def test_slots_queue_excess_requests():
    config = FakeEngineConfig(slots=1, prefill_tokens_per_s=5_000, decode_s_per_token=0)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as client:
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(str(i)))) for i in range(3)]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, server.engine.waiting)
            assert server.engine.running <= 1
            await asyncio.sleep(0.005)
        assert all(t.result().status_code == 200 for t in tasks)
    assert peak >= 1


async def test_client_disconnect_mid_stream_is_counted_as_cancelled():
    config = FakeEngineConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1_000_000)
    async with FakeEngineServer(config) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as client, \
                client.stream("POST", "/v1/chat/completions", json=chat("x", stream=True, max_tokens=100)) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk; closing the client drops the connection
        for _ in range(100):
            if server.engine.stats.cancelled:
                break
            await asyncio.sleep(0.02)
        assert server.engine.stats.cancelled == 1 and server.engine.stats.succeeded == 0
        assert server.engine.running == 0


async def test_kv_usage_counts_running_requests_not_the_resting_cache(engine):
    _, client = engine
    await client.post("/admin/fault", json={"mode": "slow_first_token", "delay_s": 0.5, "count": 1})
    slow = asyncio.create_task(client.post("/v1/chat/completions", json=chat("busy " * 200)))
    await asyncio.sleep(0.2)
    busy = (await client.get("/metrics")).text
    await slow
    idle = (await client.get("/metrics")).text

    def usage(text: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:kv_cache_usage_perc"))

    assert usage(busy) > 0 and usage(idle) == 0


def test_the_stall_tail_hits_its_share_with_a_heavy_pareto_tail():
    import random

    from kvroute.plugin.dev.fake_faults import StallTail

    tail = StallTail(share=0.05, scale_s=0.4, alpha=1.2, max_s=5.0)
    rng = random.Random(7)
    draws = [tail.draw(rng) for _ in range(20000)]
    stalls = sorted(d for d in draws if d > 0)
    assert 0.04 < len(stalls) / len(draws) < 0.06
    assert stalls[0] >= 0.4 and stalls[-1] == 5.0  # from the scale up, capped
    assert stalls[len(stalls) // 2] == pytest.approx(0.4 * 2 ** (1 / 1.2), rel=0.15)  # Pareto median
    assert [tail.draw(random.Random(7)) for _ in range(3)] == [tail.draw(random.Random(7)) for _ in range(3)]
    with pytest.raises(ConfigError):
        StallTail(share=1.5)


async def test_a_stalled_stream_starts_at_once_and_its_first_token_comes_late():
    from kvroute.plugin.dev.fake_faults import StallTail

    config = FakeEngineConfig(decode_s_per_token=0.0, stall=StallTail(share=1.0, scale_s=0.3, alpha=50, max_s=0.4))
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
        seen: list[tuple[str, float]] = []
        start = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=chat("s", stream=True)) as resp:
            seen.append(("headers", time.monotonic() - start))
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    seen.append(("content" if delta.get("content") else "role", time.monotonic() - start))
        first_content = next(t for kind, t in seen if kind == "content")
        assert [k for k, _ in seen[:2]] == ["headers", "role"] and seen[1][1] < first_content
        assert first_content - seen[1][1] >= 0.25  # the stall sits between the role chunk and the first token
