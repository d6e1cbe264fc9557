"""End to end: a real ``litellm`` proxy with a hybrid group (two queueing fake replicas + one priced fake provider).

Same proxy, same run, interleaved rounds: a burst above the fleet's capacity goes to the hybrid group and to a
self-hosted-only group of identical replicas. The hybrid group overflows to the hosted route (its share rises,
its time to first token stays near the target while the fleet-only group queues), traffic returns to the
replicas after the burst, the ledger holds rows on both sides with their costs (the hosted ones equal to what the
hybrid guard counted), and a group with a small hosted spend cap stops overflowing once the cap is spent.
One unit of cost: the ``chat`` replicas have a GPU-hour card in the price file loaded into the ledger before the
proxy starts; the decision prices them at the card and the ledger books the card (not their ``model_list``
price); the ``capped`` replicas have no card and both sides use the ``model_list`` price. The usage and margin
reports split each app's rows into self-hosted and hosted without any route kind set by the user.
Assertions are shares and ratios against the same run's baseline, never wall-clock limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from kvroute.billing.ledger import Ledger
from kvroute.billing.money import fix
from kvroute.billing.pricing import GpuRateCard
from kvroute.billing.recorder import UsageRecorder
from kvroute.billing.reports import margin_report, usage_report
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

TARGET_S = 2.0
PROMPT_TOKENS = 1800  # the fake engines count 4 bytes per token
SELF_TPS = 3000.0  # 0.6 s of prefill per request: two replicas serve ~3.3 requests/s
SELF_PRICE = {"input_cost_per_token": 2e-7, "output_cost_per_token": 8e-7}
HOSTED_PRICE = {"input_cost_per_token": 2e-6, "output_cost_per_token": 8e-6}
SPEND_WINDOW_S = 600.0
CAPPED_BUDGET = Decimal("0.02")  # hosted spend the capped group may have in one window (~5 requests)
BURST, BURST_RATE = 32, 8.0  # 8 requests/s for 4 s: 2.4x the fleet's capacity
AFTER, AFTER_RATE = 12, 1.0
ROUNDS = 3
CARD = {"gpu_hour": "2.00 USD", "gpus": 1, "prefill_tok_s": 3000, "decode_tok_s": 1000}  # != SELF_PRICE


def _prompt() -> str:
    head = f"request {uuid.uuid4().hex} "  # unique from the first byte: no prefix is shared
    return head + "tokens " * ((PROMPT_TOKENS * 4 - len(head)) // 7)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("hybrid-data")
    _load_cards(data, ("self-0", "self-1"))
    fleet_opts = ReplicaOptions(capacity_tokens=400_000, prefill_tokens_per_s=SELF_TPS, decode_ms=1.0, slots=64,
                                extra_args=("--context-cost", "0"))
    fast = ReplicaOptions(capacity_tokens=400_000, prefill_tokens_per_s=1_000_000, decode_ms=1.0, slots=256,
                          extra_args=("--context-cost", "0"))
    with contextlib.ExitStack() as es:
        mixed = es.enter_context(Fleet(2, engine="fake", options=fleet_opts, name_prefix="self"))
        alone = es.enter_context(Fleet(2, engine="fake", options=fleet_opts, name_prefix="base"))
        provider = es.enter_context(Fleet(1, engine="fake", options=fast, name_prefix="prov"))
        groups = [ModelGroup("chat", mixed.api_bases, id_prefix="self", prices=SELF_PRICE),
                  ModelGroup("chat", provider.api_bases, engine=None, id_prefix="hosted", prices=HOSTED_PRICE),
                  ModelGroup("base", alone.api_bases, id_prefix="base", prices=SELF_PRICE),
                  ModelGroup("capped", mixed.api_bases, id_prefix="cself", prices=SELF_PRICE),
                  ModelGroup("capped", provider.api_bases, engine=None, id_prefix="chosted", prices=HOSTED_PRICE)]
        cfg = build_proxy_config(groups[2:3], router_settings={"num_retries": 0})
        cfg["model_list"] = [d for g in groups for d in g.deployments()]  # two groups mix both kinds
        per_hour = CAPPED_BUDGET * Decimal(3600) / Decimal(str(SPEND_WINDOW_S))
        kvroute = {"groups": {
            "chat": {"hybrid": {"ttft_target_s": TARGET_S, "leave_ratio": 0.6, "min_dwell_s": 3.0,
                                "spend_window_s": SPEND_WINDOW_S}},
            "capped": {"hybrid": {"ttft_target_s": TARGET_S, "spend_window_s": SPEND_WINDOW_S,
                                  "max_hosted_spend_per_hour": str(per_hour)}}},
            "endpoint_auth": "open"}
        proxy = es.enter_context(ProxyProcess(cfg, kvroute_settings=kvroute, inherit_kvroute_env=False,
                                              env={"KVROUTE_DATA_DIR": str(data)}))
        yield {"proxy": proxy, "data": data}


def _load_cards(data: Path, backends: tuple[str, ...]) -> None:
    """The price file of the ``chat`` replicas (a GPU-hour card each, no route kind), loaded into the ledger."""
    from kvroute.billing.price_file import parse_price_data
    from kvroute.billing.price_store import store_prices

    pf = parse_price_data({"currency": "USD", "backends": [
        {"id": b, "provider": "vllm", "rates": [{"effective_from": "2020-01-01", **CARD}]} for b in backends]})
    led = Ledger.open(f"sqlite:///{data / 'billing.db'}")
    try:
        store_prices(led, pf)
    finally:
        led.close()


async def _one(c: httpx.AsyncClient, proxy: ProxyProcess, group: str) -> tuple[str | None, float | None, int]:
    body = {"model": group, "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": _prompt()}]}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ttft = None
    async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, headers=proxy.headers) as r:
        backend = r.headers.get("x-litellm-model-id")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: "):
                ttft = loop.time() - t0
    return backend, ttft, r.status_code


async def _paced(proxy: ProxyProcess, group: str, n: int, rate: float) -> list[tuple[str | None, float | None, int]]:
    """``n`` requests started ``1/rate`` seconds apart (arrivals do not wait for answers)."""
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(_one(c, proxy, group)))
            await asyncio.sleep(1.0 / rate)
        return list(await asyncio.gather(*tasks))


async def _sequential(proxy: ProxyProcess, group: str, n: int) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        for _ in range(n):
            await _one(c, proxy, group)


def _hosted(backend: str | None) -> bool:
    return bool(backend) and "hosted" in str(backend)


def _p90(values: list[float]) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(0.9 * len(vals)))]


def _status(proxy: ProxyProcess) -> dict:
    return httpx.get(proxy.base_url + "/kvroute/status", trust_env=False, timeout=30).json()


def _ledger_rows(data: Path) -> tuple[list, dict]:
    url = f"sqlite:///{data / 'billing.db'}"
    rec = UsageRecorder(url, data / "journal", dead_letter=data).start()  # replays what the proxy journaled
    assert rec.flush(60)
    rec.close()
    led = Ledger.open(url)
    try:
        from sqlalchemy import select

        from kvroute.billing.models import UsageEventRow as E
        catalog = led.catalog(refresh=True)
        with led.engine.connect() as conn:
            rows = list(conn.execute(select(E.backend_id, E.route_kind, E.status, E.provider_cost, E.cost_source,
                                            E.input_uncached_tokens, E.cache_read_tokens, E.output_tokens,
                                            E.occurred_at)))
            period = rows[0].occurred_at.strftime("%Y-%m")
            reports = {"usage": usage_report(conn, catalog, period, by="app"),
                       "margin": margin_report(conn, catalog, period, by="app"),
                       "backend": usage_report(conn, catalog, period, by="backend")}
            return rows, reports
    finally:
        led.close()


def test_burst_overflows_holds_the_target_returns_and_the_ledger_shows_both_sides(stack):
    proxy: ProxyProcess = stack["proxy"]
    for group in ("chat", "base", "capped"):  # the load tracker learns the replicas' speed from observed TTFT
        asyncio.run(_sequential(proxy, group, 6))
    rounds = []
    for r in range(ROUNDS):
        order = ("chat", "base") if r % 2 == 0 else ("base", "chat")  # interleaved, alternating order
        res: dict[str, dict] = {}
        for group in order:
            burst = asyncio.run(_paced(proxy, group, BURST, BURST_RATE))
            after = asyncio.run(_paced(proxy, group, AFTER, AFTER_RATE))
            assert all(code == 200 for _, _, code in burst + after)
            ttfts = [t for _, t, _ in burst if t is not None]
            res[group] = {"p90": _p90(ttfts), "met": sum(t <= TARGET_S for t in ttfts) / len(ttfts),
                          "share": sum(_hosted(b) for b, _, _ in burst) / len(burst),
                          "after_share": sum(_hosted(b) for b, _, _ in after) / len(after),
                          "tail_hosted": sum(_hosted(b) for b, _, _ in after[-6:])}
        rounds.append(res)
        print(f"round {r}: hybrid burst p90 {res['chat']['p90']:.2f}s met {res['chat']['met']:.0%} "
              f"overflow {res['chat']['share']:.0%} after {res['chat']['after_share']:.0%} | fleet-only burst "
              f"p90 {res['base']['p90']:.2f}s met {res['base']['met']:.0%}")
    med = {g: {k: statistics.median(rd[g][k] for rd in rounds) for k in rounds[0][g]} for g in ("chat", "base")}
    ratio = med["chat"]["p90"] / med["base"]["p90"]
    print(f"medians over {ROUNDS} rounds: burst TTFT p90 hybrid/fleet-only {ratio:.2f}; target met "
          f"{med['chat']['met']:.0%} vs {med['base']['met']:.0%}; overflow share in burst {med['chat']['share']:.0%}, "
          f"after {med['chat']['after_share']:.0%}")
    assert med["base"]["share"] == 0  # the baseline never leaves its replicas
    assert med["chat"]["share"] >= 0.3  # the burst raised the overflow share ...
    assert ratio <= 0.6 and med["chat"]["met"] >= med["base"]["met"] + 0.3  # ... and it held the target
    assert med["chat"]["after_share"] <= 0.25 and all(rd["chat"]["tail_hosted"] == 0 for rd in rounds)  # it returned

    status = _status(proxy)["groups"]["chat"]["hybrid"]
    assert status["reasons"].get("overflow_latency", 0) > 0 and status["reasons"].get("self_hosted", 0) > 0
    assert status["last"]["target_s"] == TARGET_S and "predicted_s" in status["last"]
    metrics = httpx.get(proxy.base_url + "/kvroute/metrics", trust_env=False, timeout=30).text
    assert 'kvroute_hybrid_decisions_total{group="chat",reason="overflow_latency",side="hosted"}' in metrics
    assert 'kvroute_predicted_ttft_seconds_count{backend="hosted-0"}' in metrics

    # the spend cap: a burst on the capped group overflows only until the window's budget is spent
    burst = asyncio.run(_paced(proxy, "capped", BURST, BURST_RATE))
    assert all(code == 200 for _, _, code in burst)
    capped = _status(proxy)["groups"]["capped"]["hybrid"]
    print(f"capped group: {sum(_hosted(b) for b, _, _ in burst)} of {BURST} burst requests hosted, reasons "
          f"{capped['reasons']}, hosted spend {capped['hosted_spend_total']} of a {CAPPED_BUDGET} window budget")
    assert capped["reasons"].get("guard_spend", 0) > 0 and capped["reasons"].get("overflow_latency", 0) > 0
    assert Decimal(capped["hosted_spend_window"]) <= CAPPED_BUDGET

    rows, reports = _ledger_rows(stack["data"])
    by_backend: dict[str, list] = {}
    for row in rows:
        by_backend.setdefault(row.backend_id, []).append(row)
    hosted_cost = sum((r.provider_cost for r in by_backend.get("hosted-0", [])), Decimal(0))
    self_rows = by_backend.get("self-0", []) + by_backend.get("self-1", [])
    print(f"ledger: {len(self_rows)} self-hosted rows (cost {sum(r.provider_cost for r in self_rows)}), "
          f"{len(by_backend.get('hosted-0', []))} hosted rows (cost {hosted_cost}); hybrid guard counted "
          f"{status['hosted_spend_total']}")
    assert self_rows and all(r.provider_cost > 0 and r.status == "success" for r in self_rows)
    assert by_backend.get("hosted-0") and all(r.provider_cost > 0 for r in by_backend["hosted-0"])
    per_row = {side: sum(r.provider_cost for r in rs) / len(rs) for side, rs in (("self", self_rows),
                                                                                ("hosted", by_backend["hosted-0"]))}
    assert per_row["hosted"] > 5 * per_row["self"]  # each side booked at its own price (10x apart per token)
    counted = Decimal(_status(proxy)["groups"]["chat"]["hybrid"]["hosted_spend_total"])
    assert abs(hosted_cost - counted) <= Decimal("1e-9") * max(hosted_cost, Decimal(1))  # decision and ledger agree
    capped_cost = sum((r.provider_cost for r in by_backend.get("chosted-0", [])), Decimal(0))
    assert 0 < capped_cost <= CAPPED_BUDGET

    # one unit of cost: the per-token price each decision used for a replica is what the ledger booked for it
    from collections import Counter
    print("rows by backend, kind, cost source:", dict(Counter((r.backend_id, r.route_kind, r.cost_source, r.status)
                                                             for r in rows)))
    statuses = _status(proxy)["groups"]
    card_in, card_out = GpuRateCard(Decimal("2.00"), Decimal(3000), Decimal(1000)).per_token()
    model_list = (Decimal(str(SELF_PRICE["input_cost_per_token"])), Decimal(str(SELF_PRICE["output_cost_per_token"])))
    for group, replicas, expected, source in (("chat", ("self-0", "self-1"), (card_in, card_out),
                                               "self_hosted_amortized"),
                                              ("capped", ("cself-0", "cself-1"), model_list, None)):
        used = statuses[group]["hybrid"]["self_hosted_rates"]
        for b in replicas:
            decided = (Decimal(used[b]["input"]), Decimal(used[b]["output"]))
            assert decided == expected, (group, b, decided)
            booked = [r for r in by_backend.get(b, []) if r.status == "success"]
            assert booked, b
            for r in booked:  # prompts are unique: no cached tokens, every prompt token at the input price
                assert r.cache_read_tokens == 0  # LiteLLM's cost (it copies it into usage.cost) without a card
                assert (r.cost_source == source) if source else (r.cost_source == "litellm"), (b, r.cost_source)
                per_token = fix(decided[0] * r.input_uncached_tokens + decided[1] * r.output_tokens)  # 1e-10
                if source:  # the card: the very same Decimal amount
                    assert r.provider_cost == per_token, (b, r.provider_cost, per_token)
                else:  # LiteLLM's float cost of the same per-token prices
                    assert abs(r.provider_cost - per_token) <= Decimal("1e-10"), (b, r.provider_cost, per_token)
    print(f"one unit: chat replicas decided and booked at the GPU-hour card {card_in}/{card_out} per token, "
          f"capped replicas at their model_list price {model_list[0]}/{model_list[1]}")

    # route kinds: derived from the deployments (no kvroute_route_kind, no route_kind in the price file)
    kinds = {b: {r.route_kind for r in rs} for b, rs in by_backend.items() if b != "router"}
    assert all(kinds[b] == {"self_hosted"} for b in ("self-0", "self-1", "cself-0", "cself-1", "base-0", "base-1"))
    assert kinds["hosted-0"] == {"direct"} and kinds["chosted-0"] == {"direct"}
    self_ids = {b for b in kinds if kinds[b] == {"self_hosted"}}
    for kind in ("usage", "margin"):
        for app_row in reports[kind]:
            app = app_row["app_id"]
            mine = [r for r in reports["backend"] if r["app_id"] == app]
            want_self = sum((r["provider_cost"] + r["absorbed_cost"] for r in mine if r["backend_id"] in self_ids),
                            Decimal(0))
            want_hosted = sum((r["provider_cost"] + r["absorbed_cost"] for r in mine
                               if r["backend_id"] not in self_ids), Decimal(0))
            print(f"{kind} report, app {app}: self-hosted {app_row['self_hosted_cost']}, "
                  f"hosted {app_row['hosted_cost']}")
            assert (app_row["self_hosted_cost"], app_row["hosted_cost"]) == (want_self, want_hosted)
            assert want_self > 0 and want_hosted > 0
