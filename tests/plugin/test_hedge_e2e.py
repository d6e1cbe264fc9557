"""Hedged streams through a real proxy: the preferred hosted route stalls its first token on 4 of 20 streams.

Two hosted fakes serve the ``hosted`` group (price-only marketplace: ``provider-a`` is preferred). The same
sequence runs through a proxy with ``hedge:`` set and one without; the stalled streams cost the client 3 s
without hedging and well under 1.5 s with it, within the hedge budget, the losing streams are closed upstream at
once, and the ledger's report counts the hedges and their cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from outcome_stack import kvroute_proxy, stack_config

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]

STALL_S = 3.0
STALLED = (2, 7, 12, 17)  # of the 20 measured streams
HEDGE = {"budget": "20%", "floor": 2, "min_samples": 8, "min_delay_ms": 150, "max_delay_ms": 1500}
GROUPS = {"llama": {"policy": "cache_aware"},
          "hosted": {"policy": "marketplace", "knobs": {"ttft_weight": 0.0, "throughput_weight": 0.0}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=2.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(1, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        cfg = stack_config(replicas.api_bases, hosted.api_bases)
        hedged_groups = {**GROUPS, "hosted": {**GROUPS["hosted"], "hedge": HEDGE}}
        data = tmp_path_factory.mktemp("hedge-ledger")
        ours = es.enter_context(kvroute_proxy(cfg, env={"KVROUTE_DATA_DIR": str(data)}, groups=hedged_groups))
        plain = es.enter_context(kvroute_proxy(cfg, env={"KVROUTE_DATA_DIR": str(tmp_path_factory.mktemp("plain"))},
                                               groups=GROUPS))
        yield {"hedged": ours, "plain": plain, "hosted": hosted, "data": data}


async def stream(c: httpx.AsyncClient, proxy, text: str) -> tuple[float, float, str | None]:
    """(TTFT seconds, wall time of the first content chunk, deployment id) of one streamed request."""
    body = {"model": "hosted", "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    start = time.monotonic()
    ttft = first_wall = None
    async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, headers=proxy.headers,
                        timeout=30) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: ") and not line.endswith("[DONE]"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft, first_wall = time.monotonic() - start, time.time()
        model_id = resp.headers.get("x-litellm-model-id")
    assert ttft is not None
    return ttft, first_wall, model_id


async def run_sequence(proxy, hosted: Fleet) -> list[tuple[float, float, str | None]]:
    """10 warm-up streams (TTFT samples), then 20 measured, the preferred route stalling on ``STALLED``."""
    preferred = hosted.base_urls[0]  # provider-a: the cheaper one, chosen on price alone
    async with httpx.AsyncClient(trust_env=False) as c:
        for i in range(10):
            await stream(c, proxy, f"warm-up {i} " * 20)
        out = []
        for i in range(20):
            if i in STALLED:
                r = await c.post(preferred + "/admin/fault",
                                 json={"mode": "stall_first_token", "delay_s": STALL_S, "count": 1})
                r.raise_for_status()
            out.append(await stream(c, proxy, f"measured {i} " * 20))
        await c.delete(preferred + "/admin/fault")
    return out


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


async def hedge_counts(proxy) -> dict[str, float]:
    """``kvroute_hedges_total`` of the ``hosted`` group by event."""
    async with httpx.AsyncClient(trust_env=False) as c:
        text = (await c.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers)).text
    out = {}
    for m in re.finditer(r'^kvroute_hedges_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if labels.get("group") == "hosted":
            out[labels["event"]] = float(m[2])
    return out


async def test_hedging_cuts_the_stalled_streams_tail_within_its_budget(stack):
    plain = await run_sequence(stack["plain"], stack["hosted"])
    before_closes = len(await engine_closes(stack["hosted"].base_urls[0]))
    hedged = await run_sequence(stack["hedged"], stack["hosted"])
    plain_p90, hedged_p90 = p90([t for t, _, _ in plain]), p90([t for t, _, _ in hedged])
    assert plain_p90 >= STALL_S * 0.9, plain_p90  # without hedging the stalls are the tail
    assert hedged_p90 <= 1.5, (hedged_p90, [round(t, 3) for t, _, _ in hedged])
    print(f"TTFT p90 without hedging {plain_p90:.3f} s, with {hedged_p90:.3f} s; stalled streams "
          f"{[round(hedged[i][0], 3) for i in STALLED]} s")
    for i in STALLED:  # (the response headers name the first route: they went out before the race)
        assert hedged[i][0] <= 1.5 < plain[i][0], (i, hedged[i], plain[i])
    counts = await hedge_counts(stack["hedged"])
    assert counts.get("sent", 0) == len(STALLED), counts
    assert counts["sent"] <= HEDGE["floor"] + 0.20 * 30  # 30 streams went through the group
    assert counts.get("won", 0) == len(STALLED), counts
    closes = (await engine_closes(stack["hosted"].base_urls[0]))[before_closes:]
    assert len(closes) == len(STALLED), closes  # the stalled primaries were closed, not left to finish
    for i, closed in zip(STALLED, closes, strict=True):
        assert abs(closed - hedged[i][1]) <= 0.1, (i, closed - hedged[i][1])  # closed upstream at once
    await asyncio.sleep(1.0)
    report = await usage_report(stack["data"])
    row = next(r for r in report["rows"] if r["hedged_requests"])
    assert (row["hedged_requests"], row["hedge_wins"]) == (len(STALLED), len(STALLED)), row
    assert float(row["hedge_cost"]) > 0, row  # the losers' prompts, priced at provider-a's rate
    assert row["requests_total"] == 30 and row["requests_success"] == 30, row  # one answer each, none twice
    rows = ledger_rows(stack["data"])
    hedged_ids = {r.request_id for r in rows if r.error_type == "hedge_lost"}
    for rid in hedged_ids:  # the loser (the stalled first route) and the answer, under one request id
        mine = sorted((r.attempt_no, r.status, r.is_final_attempt, r.backend_id) for r in rows if r.request_id == rid)
        assert mine == [(1, "cancelled", False, "provider-a"), (2, "success", True, "provider-b")], mine


def ledger_rows(data: Path) -> list:
    from sqlalchemy import create_engine, select

    from kvroute.billing.models import UsageEventRow as E

    engine = create_engine(f"sqlite:///{data / 'billing.db'}")
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(E.request_id, E.attempt_no, E.status, E.is_final_attempt, E.backend_id,
                                            E.error_type)))
    finally:
        engine.dispose()


async def engine_closes(base_url: str) -> list[float]:
    async with httpx.AsyncClient(trust_env=False) as c:
        return (await c.get(base_url + "/admin/stats")).json()["stall_closes"]


async def usage_report(data) -> dict:
    """``kvroute report usage --by app`` of the proxy's ledger, once the hedges reached it (30 s at most)."""
    command = [str(Path(sys.executable).parent / "kvroute"), "report", "usage", "--by", "app", "--format", "json",
               "--period", datetime.now(UTC).strftime("%Y-%m"), "--db", f"sqlite:///{data / 'billing.db'}"]
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode == 0:
            report = json.loads(out.stdout)
            if any(r.get("hedged_requests") for r in report["rows"]) or time.monotonic() > deadline:
                return report
        elif time.monotonic() > deadline:
            raise AssertionError(out.stderr[-2000:])
        await asyncio.sleep(1.0)
