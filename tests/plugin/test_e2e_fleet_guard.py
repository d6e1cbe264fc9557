"""End to end: three proxy instances, one Redis, one hosted spend cap for all of them.

Three real ``litellm`` proxies (own ports, own data directories and ledgers, one Redis, one hash secret) serve
two hybrid groups whose replicas nobody listens on (their breakers open on the first failure) and one priced
fake provider. Requests go round robin over the instances, one to each at the same moment.

- ``capped``: 30 requests against a cap of 0.05 per hour: the hosted spend the three ledgers booked in the
  window stays within the cap plus one request's price; the baseline (the same three instances without Redis,
  each guarding its own spend) passes the cap by far.
- ``outage``: Redis is stopped first; each instance then spends at most its conservative share (the cap divided
  by the three instances it knew), says ``local_share`` in its status; when Redis returns (empty) the shared
  window holds what the instances billed while it was away.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

HOSTED_PRICE = {"input_cost_per_token": 2e-6, "output_cost_per_token": 8e-6}
SELF_PRICE = {"input_cost_per_token": 2e-7, "output_cost_per_token": 8e-7}
CAP = Decimal("0.05")  # per hour, the spend window is the default hour: the window's budget is the cap
OUTAGE_CAP = Decimal("0.03")
INSTANCES = 3
REQUESTS = 30
SECRET = "fleet-guard-e2e-secret-0123456789"


def _dead_base() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def _config(provider: list[str]) -> tuple[dict, dict]:
    groups = [ModelGroup("capped", [_dead_base(), _dead_base()], id_prefix="cself", prices=SELF_PRICE),
              ModelGroup("capped", provider, engine=None, id_prefix="chosted", prices=HOSTED_PRICE),
              ModelGroup("outage", [_dead_base(), _dead_base()], id_prefix="oself", prices=SELF_PRICE),
              ModelGroup("outage", provider, engine=None, id_prefix="ohosted", prices=HOSTED_PRICE)]
    cfg = build_proxy_config(groups[:1], router_settings={"num_retries": 0})
    cfg["model_list"] = [d for g in groups for d in g.deployments()]
    hybrid = {"ttft_target_s": 2.0}
    kvroute = {"groups": {"capped": {"hybrid": {**hybrid, "max_hosted_spend_per_hour": str(CAP)}},
                          "outage": {"hybrid": {**hybrid, "max_hosted_spend_per_hour": str(OUTAGE_CAP)}}},
               "breaker": {"consecutive_failures": 1, "min_requests": 1, "base_cooldown_s": 600,
                           "max_cooldown_s": 600, "jitter": 0},
               "endpoint_auth": "open"}
    return cfg, kvroute


def _proxies(es: contextlib.ExitStack, tmp_path_factory, redis_url: str | None) -> tuple[list, list]:
    """Three instances on one fake provider; with ``redis_url`` they share state (one namespace, one secret)."""
    fast = ReplicaOptions(capacity_tokens=400_000, prefill_tokens_per_s=1_000_000, decode_ms=1.0, slots=64,
                          extra_args=("--context-cost", "0"))
    provider = es.enter_context(Fleet(1, engine="fake", options=fast, name_prefix="prov"))
    cfg, kvroute = _config(provider.api_bases)
    if redis_url:
        kvroute.update(redis_url=redis_url, redis_namespace=f"kvtest-fleet-{uuid.uuid4().hex[:8]}",
                       hash_secret=SECRET)
    proxies, dirs = [], []
    for i in range(INSTANCES):
        data = tmp_path_factory.mktemp(f"instance-{i}")
        dirs.append(data)
        proxy = ProxyProcess(cfg, kvroute_settings=kvroute, inherit_kvroute_env=False,
                             env={"KVROUTE_DATA_DIR": str(data)})
        proxies.append(es.enter_context(proxy))  # from this thread: a child dies with the thread that spawned it
    return proxies, dirs


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from loopback import REDIS, RedisServer

    if REDIS is None:
        pytest.skip("needs the redis-server binary (the test stops and restarts it)")
    with contextlib.ExitStack() as es:
        redis = RedisServer(REDIS)
        redis.start()
        es.callback(redis.stop)
        proxies, dirs = _proxies(es, tmp_path_factory, redis.url)
        yield {"proxies": proxies, "dirs": dirs, "redis": redis}


def _hosted_costs(data: Path, backend: str) -> list[Decimal]:
    url = f"sqlite:///{data / 'billing.db'}"
    rec = UsageRecorder(url, data / "journal", dead_letter=data).start()
    assert rec.flush(60)
    rec.close()
    led = Ledger.open(url)
    try:
        from sqlalchemy import select

        from kvroute.billing.models import UsageEventRow as E
        with led.engine.connect() as conn:
            return [r.provider_cost for r in conn.execute(select(E.provider_cost).where(
                (E.backend_id == backend) & (E.status == "success")))]
    finally:
        led.close()


async def _round_robin(proxies: list[ProxyProcess], group: str, n: int) -> list[tuple[int, int, str | None]]:
    """``n`` requests, one to each instance at the same moment, round after round: (instance, status, backend)."""
    out: list[tuple[int, int, str | None]] = []
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        async def one(i: int) -> tuple[int, int, str | None]:
            p = proxies[i % len(proxies)]
            body = {"model": group, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"q {uuid.uuid4().hex} " + "tokens " * 1100}]}
            r = await c.post(p.base_url + "/v1/chat/completions", json=body, headers=p.headers)
            return i % len(proxies), r.status_code, r.headers.get("x-litellm-model-id")

        for start in range(0, n, len(proxies)):
            out += await asyncio.gather(*(one(i) for i in range(start, min(n, start + len(proxies)))))
    return out


def _status(p: ProxyProcess) -> dict:
    return httpx.get(p.base_url + "/kvroute/status", trust_env=False, timeout=30).json()


def _wait(cond, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_three_instances_spend_within_one_cap_and_their_shares_while_redis_is_away(stack):
    proxies, dirs, redis = stack["proxies"], stack["dirs"], stack["redis"]
    for p in proxies:
        assert p.process is not None and p.process.poll() is None, p.log_text()[-3000:]
    assert _wait(lambda: all(_status(p)["shared_state"]["instances"] == INSTANCES for p in proxies))

    # --- one cap for the fleet ---------------------------------------------------------------------------
    outcomes = asyncio.run(_round_robin(proxies, "capped", REQUESTS))
    costs = [c for d in dirs for c in _hosted_costs(d, "chosted-0")]
    served = [o for o in outcomes if o[1] == 200]
    spent, price = sum(costs, Decimal(0)), max(costs)
    hy = _status(proxies[0])["groups"]["capped"]["hybrid"]
    print(f"\n3 instances sharing Redis, cap {CAP}: {len(served)}/{REQUESTS} served hosted, ledgers {spent} "
          f"({spent / CAP:.2f}x the cap; one request {price}); fleet window {hy['hosted_spend_window']}; "
          f"reasons {hy['reasons']}")
    assert len(costs) == len(served) >= 2
    assert spent <= CAP + price, (spent, CAP, price)
    assert hy["guard_scope"] == "fleet" and hy["guard_instances"] == INSTANCES
    assert Decimal(hy["hosted_spend_window"]) >= spent  # the window holds every instance's billed spend
    assert any(o[1] != 200 for o in outcomes[-INSTANCES:])  # the cap refused, on whatever instance

    # --- Redis away: each instance keeps to its share ---------------------------------------------------------
    redis.stop()
    assert _wait(lambda: all(not _status(p)["shared_state"]["connected"] for p in proxies))
    outcomes = asyncio.run(_round_robin(proxies, "outage", REQUESTS))
    share = OUTAGE_CAP / INSTANCES
    per = [sum(_hosted_costs(d, "ohosted-0"), Decimal(0)) for d in dirs]
    scopes = [_status(p)["groups"]["outage"]["hybrid"] for p in proxies]
    print(f"Redis away, cap {OUTAGE_CAP}: per instance {[str(x) for x in per]} (share {share:.6f}); "
          f"scopes {[s['guard_scope'] for s in scopes]}")
    assert all(s["guard_scope"] == "local_share" for s in scopes)
    assert all(Decimal(s["hosted_budget_local_share"]) == share for s in scopes)
    assert all(x <= share for x in per) and sum(per) <= OUTAGE_CAP and sum(per) > 0

    # --- Redis back (empty): the window reconciles ------------------------------------------------------------
    redis.start()
    assert _wait(lambda: all(_status(p)["shared_state"]["connected"] for p in proxies), timeout=60)

    def reconciled() -> bool:
        hy = _status(proxies[0])["groups"]["outage"]["hybrid"]
        return hy["guard_scope"] == "fleet" and Decimal(hy["hosted_spend_window"]) >= sum(per)

    assert _wait(reconciled, timeout=30)
    # the spend before the outage is booked again too (each instance within a heartbeat of its reconnect)
    assert _wait(lambda: Decimal(_status(proxies[1])["groups"]["capped"]["hybrid"]["hosted_spend_window"]) >= spent,
                 timeout=30), _status(proxies[1])["groups"]["capped"]["hybrid"]


def test_baseline_three_instances_without_shared_state_each_spend_the_cap(tmp_path_factory):
    """The same set-up without Redis: each instance guards only its own spend, so together they pass the cap
    (what the shared guard above prevents)."""
    with contextlib.ExitStack() as es:
        proxies, dirs = _proxies(es, tmp_path_factory, None)
        outcomes = asyncio.run(_round_robin(proxies, "capped", REQUESTS))
        costs = [c for d in dirs for c in _hosted_costs(d, "chosted-0")]
    spent = sum(costs, Decimal(0))
    print(f"\n3 instances, no shared state, cap {CAP}: {sum(o[1] == 200 for o in outcomes)}/{REQUESTS} served "
          f"hosted, ledgers {spent} ({spent / CAP:.2f}x the cap)")
    assert spent > CAP + max(costs)
