"""A client that goes away is still a bill: cut streams and abandoned requests through a real proxy.

A real LiteLLM proxy with kvroute and its default ledger (embedded SQLite in the data directory) in front of
fake self-hosted replicas and two hosted fakes; ``cancel_on_disconnect`` on, so LiteLLM's own disconnect
accounting (its 499) fires beside kvroute's. Every request the client abandoned must be in the ledger once,
as ``cancelled``, with its prompt tokens and the output the client got; nothing else may be booked twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from decimal import Decimal

import httpx
import pytest
from outcome_stack import HOSTED_PRICES, attempts, kvroute_proxy, stack_config
from sqlalchemy import create_engine, select

from kvroute.billing.models import UsageEventRow as E
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

CUT_AFTER = 3  # content chunks the client reads before it goes away
ANSWER_TOKENS = 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("ledger")
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=40.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        cfg = stack_config(replicas.api_bases, hosted.api_bases)
        cfg.setdefault("general_settings", {})["cancel_on_disconnect"] = True
        proxy = es.enter_context(kvroute_proxy(cfg, env={"KVROUTE_DATA_DIR": str(data)}))
        yield {"proxy": proxy, "db": f"sqlite:///{data / 'billing.db'}", "data": data}


def body(model: str, text: str, *, stream: bool) -> dict:
    out = {"model": model, "max_tokens": ANSWER_TOKENS, "stream": stream,
           "messages": [{"role": "user", "content": text}]}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def cut_stream(c: httpx.AsyncClient, proxy, payload: dict) -> int:
    """Read ``CUT_AFTER`` content chunks, then close the connection; the content chunks read."""
    got = 0
    async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json=payload, headers=proxy.headers,
                        timeout=30) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                got += 1
                if got >= CUT_AFTER:
                    break  # leaving the block closes the connection mid-stream
    return got


async def abandon(c: httpx.AsyncClient, proxy, payload: dict) -> None:
    """Send a non-streamed request and hang up before the answer (``ANSWER_TOKENS`` × 40 ms of decode)."""
    with pytest.raises(httpx.ReadTimeout):
        await c.post(proxy.base_url + "/v1/chat/completions", json=payload, headers=proxy.headers,
                     timeout=httpx.Timeout(30, read=0.6))


def ledger_rows(db: str, request_ids: set[str] | None = None) -> list:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            rows = list(conn.execute(select(E.request_id, E.attempt_no, E.status, E.is_final_attempt,
                                            E.input_uncached_tokens, E.cache_read_tokens, E.output_tokens,
                                            E.backend_id, E.raw_usage, E.provider_cost, E.billed_amount)))
    finally:
        engine.dispose()
    return [r for r in rows if request_ids is None or r.request_id in request_ids]


async def wait_rows(db: str, count: int, timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    rows: list = []
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            rows = ledger_rows(db)
            if len(rows) >= count:
                return rows
        await asyncio.sleep(0.5)
    return rows


async def test_every_cancelled_request_is_booked_once_with_its_prompt_and_relayed_output(stack):
    proxy, db = stack["proxy"], stack["db"]
    async with httpx.AsyncClient(trust_env=False) as c:
        normal = await c.post(proxy.base_url + "/v1/chat/completions", headers=proxy.headers, timeout=30,
                              json=body("llama", "a normal request " * 20, stream=False))
        assert normal.status_code == 200
        relayed = []
        for i in range(3):
            for model in ("llama", "hosted"):
                relayed.append(await cut_stream(c, proxy, body(model, f"cut stream {model} {i} " * 40, stream=True)))
        assert relayed == [CUT_AFTER] * 6
        for model in ("llama", "hosted"):
            await abandon(c, proxy, body(model, f"abandoned {model} " * 40, stream=False))
    rows = await wait_rows(db, 1 + 6 + 2)
    await asyncio.sleep(3.0)  # anything LiteLLM logs late (its failure events) would land by now
    rows = ledger_rows(db)
    by_request: dict[str, list] = {}
    for r in rows:
        by_request.setdefault(r.request_id, []).append(r)
    finals = [r for r in rows if r.is_final_attempt]
    assert len(by_request) == 9, [(r.request_id, r.status, r.attempt_no) for r in rows]
    assert len(finals) == 9, [(r.request_id, r.status, r.attempt_no, r.is_final_attempt) for r in rows]
    cancelled = [r for r in finals if r.status == "cancelled"]
    assert len(cancelled) == 8, [(r.status, r.backend_id) for r in finals]
    assert sum(1 for r in finals if r.status == "success") == 1
    for r in cancelled:  # the prompt the provider read: every word of it is at least one token
        assert r.input_uncached_tokens + r.cache_read_tokens >= 80, r
    streamed = [r for r in cancelled if r.output_tokens > 0]
    assert len(streamed) == 6, [(r.backend_id, r.output_tokens) for r in cancelled]
    assert all(CUT_AFTER <= r.output_tokens < ANSWER_TOKENS for r in streamed), [r.output_tokens for r in streamed]
    backends = {r.backend_id for r in cancelled}
    assert any(b.startswith("llama") for b in backends) and backends & {"provider-a", "provider-b"}, backends
    prices = dict(zip(("provider-a", "provider-b"), HOSTED_PRICES, strict=True))
    for r in cancelled:  # billed like an answer (no price book: at cost), priced from the tokens booked
        if r.backend_id in prices:
            p = prices[r.backend_id]
            expected = (Decimal(str(p["input_cost_per_token"])) * (r.input_uncached_tokens + r.cache_read_tokens)
                        + Decimal(str(p["output_cost_per_token"])) * r.output_tokens)
            assert r.billed_amount == expected > 0, (r.backend_id, r.billed_amount, expected)
    for rows_of in by_request.values():  # nothing double-booked: one row per attempt
        assert len({r.attempt_no for r in rows_of}) == len(rows_of), rows_of
    # the metrics agree with the ledger: LiteLLM's success log of a stream whose client left (it comes after the
    # cancel) is no completion
    outcomes: dict[str, float] = {}
    for (_, outcome), n in (await attempts(proxy)).items():
        outcomes[outcome] = outcomes.get(outcome, 0.0) + n
    assert outcomes.get("success") == 1 and outcomes.get("cancelled") == 8, outcomes
