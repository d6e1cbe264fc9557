"""Budget rejections blame no backend: LiteLLM 1.110.2's budgets, really enforced by real proxies, with and
without kvroute on the same fake engines.

What LiteLLM enforces without a database (measured through its proxy; the tests below are the evidence):

* per-deployment ``litellm_params.max_budget`` + ``budget_duration`` and ``router_settings.provider_budget_config``:
  ``RouterBudgetLimiting``, spend windows in the router's in-memory cache, a routing filter that drops deployments
  over budget and raises ``No deployments available - crossed budget`` (429) when none is left;
* ``litellm_settings.max_budget`` (the SDK's global budget): its counter ``litellm._current_cost`` never moves for
  a chat completion and the proxy warns it "will NOT be enforced" without a DB, so it bites only when already
  spent (a negative limit): ``BudgetExceededError`` (422) from the SDK's client wrapper, *after* the router's pick;
* a key's ``max_budget`` from ``general_settings.custom_auth`` with ``custom_auth_run_common_checks: true``: the
  proxy counts the key's spend in its in-memory spend counter and its auth refuses the key (422
  ``Budget has been exceeded! Key=...``) before any routing;
* key, team, user and end-user budgets of virtual keys need the proxy DB (prisma is not installed).

Each case: the client sees the same status with and without kvroute, no blaming attempt in
``kvroute_attempts_total``, every breaker closed, the ledger books the rejection as ``no_route`` on backend
``router`` (never on a backend), and once the budget window has passed the same backend serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest
from outcome_stack import (
    KVROUTE_SETTINGS,
    OFFLINE_ENV,
    attempts,
    breakers,
    chat,
    delta,
    kvroute_proxy,
    plain_proxy,
    send,
    stack_config,
)

from kvroute.billing.ledger import Ledger
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

BLAMING = ("provider_failure", "capacity", "config_failure")
WINDOW_S = 10  # every budget's window: spend resets (its cache key expires) this long after the first spend
TINY = 1e-9  # below one request's cost: one request spends the budget
PRICES = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
CHEAP = {"input_cost_per_token": 1e-8, "output_cost_per_token": 2e-8}  # provider-a: 100x below provider-b
REJECTED = 5  # more than the breaker's consecutive_failures (3)


def budget_config(replicas: list[str], hosted: list[str], extra: list[str], *, kvroute: bool) -> dict:
    """The attribution stack plus three budgets: ``provider-a`` (one of two in ``hosted``), ``solo`` (one
    deployment, over budget = nothing left) and ``capped`` (two ``hosted_vllm`` deployments under one provider
    budget)."""
    cfg = stack_config(replicas, hosted, kvroute=kvroute, router={"num_retries": 0})
    budget = {"max_budget": TINY, "budget_duration": f"{WINDOW_S}s"}
    for dep in cfg["model_list"]:
        if dep["model_info"]["id"] == "provider-a":  # so cheap that kvroute's marketplace picks it when it may
            dep["litellm_params"].update(**CHEAP, **budget)
            dep["model_info"].update(CHEAP)
    cfg["model_list"].append({"model_name": "solo",
                              "litellm_params": {"model": "openai/fake-model", "api_base": extra[0], "api_key": "none",
                                                 **PRICES, **budget},
                              "model_info": {"id": "solo-0", "provider": "solo-provider", **PRICES}})
    for i, base in enumerate(extra[1:]):
        cfg["model_list"].append({"model_name": "capped",
                                  "litellm_params": {"model": "hosted_vllm/fake-model", "api_base": base,
                                                     "api_key": "none", **PRICES},
                                  "model_info": {"id": f"capped-{i}", "provider": f"capped-{i}", **PRICES}})
    cfg["router_settings"]["provider_budget_config"] = {
        "hosted_vllm": {"budget_limit": TINY, "time_period": f"{WINDOW_S}s"}}
    return cfg


GROUPS = {**KVROUTE_SETTINGS["groups"], "solo": {"policy": "marketplace"}, "capped": {"policy": "marketplace"}}


@pytest.fixture(scope="module")
def budget_stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("budget-ledger")
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        extra = es.enter_context(Fleet(3, engine="fake", options=opts, name_prefix="extra"))
        args = (replicas.api_bases, hosted.api_bases, extra.api_bases)
        ours = es.enter_context(kvroute_proxy(budget_config(*args, kvroute=True), groups=GROUPS,
                                              env={"KVROUTE_DATA_DIR": str(data)}))
        plain = es.enter_context(plain_proxy(budget_config(*args, kvroute=False)))
        yield {"ours": ours, "plain": plain, "ledger": f"sqlite:///{data / 'billing.db'}"}


def blamed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k[1] in BLAMING}


async def run(proxy: ProxyProcess, bodies: list[dict]) -> list:
    async with httpx.AsyncClient(trust_env=False) as c:
        out = []
        for body in bodies:
            out.append(await send(c, proxy, body))
            await asyncio.sleep(0.2)  # LiteLLM books a success's spend after the reply
        return out


async def served_again(proxy: ProxyProcess, model: str, backends: set[str], tag: str) -> list:
    """Requests until one is served by one of ``backends`` (the budget window has passed); gives up after
    three windows."""
    deadline = time.monotonic() + 3 * WINDOW_S + 10
    replies = []
    async with httpx.AsyncClient(trust_env=False) as c:
        while time.monotonic() < deadline:
            replies.append(await send(c, proxy, chat(f"{tag} again {len(replies)}", model=model,
                                                     user=f"{tag}-again-{len(replies)}")))
            if replies[-1].ok and replies[-1].backend in backends:
                break
            await asyncio.sleep(1.0)
    return replies


def ledger_rows(url: str, users_prefix: str, want: int, timeout_s: float = 30.0) -> list:
    """The ledger rows of requests whose ``user`` starts with ``users_prefix``, once ``want`` of them are final
    (one final row per request; a request's earlier rows are journaled, hence stored, before its final one)."""
    from sqlalchemy import select

    from kvroute.billing.models import UsageEventRow as E
    deadline = time.monotonic() + timeout_s
    rows: list = []
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            led = Ledger.open(url)
            try:
                with led.engine.connect() as conn:
                    rows = [r for r in conn.execute(select(E.end_user_id, E.status, E.is_final_attempt,
                                                           E.backend_id, E.provider_cost, E.http_status))
                            if (r.end_user_id or "").startswith(users_prefix)]
            finally:
                led.close()
            if sum(1 for r in rows if r.is_final_attempt) >= want:
                return rows
        time.sleep(0.5)
    return rows


async def rejected_everywhere(stack, model: str, tag: str, backends: set[str]) -> None:
    """Spend ``model``'s budget, then send ``REJECTED`` more requests to both proxies: identical statuses, the
    429 "crossed budget" rejections blame nobody, the ledger books them as router-level, and after the window
    the same backend serves again."""
    ours, plain = stack["ours"], stack["plain"]
    before = await attempts(ours)
    bodies = [chat(f"{tag} {i}", model=model, user=f"{tag}-{i}") for i in range(1 + REJECTED)]
    mine, theirs = await asyncio.gather(run(ours, bodies), run(plain, bodies))
    d = delta(await attempts(ours), before)
    states = await breakers(ours)
    assert [r.status for r in mine] == [r.status for r in theirs], ([r.text for r in mine], [r.text for r in theirs])
    assert mine[0].ok and mine[0].backend in backends, mine[0]
    assert [r.status for r in mine[1:]] == [429] * REJECTED, [r.text for r in mine[1:]]
    assert all("crossed budget" in r.text for r in mine[1:]), mine[1].text
    assert blamed(d) == {}, d
    assert all(states[b] == "closed" for b in backends) and set(states.values()) == {"closed"}, states

    rows = ledger_rows(stack["ledger"], f"{tag}-", 1 + REJECTED)
    finals = {r.end_user_id: r for r in rows if r.is_final_attempt}
    assert finals[f"{tag}-0"].status == "success" and finals[f"{tag}-0"].backend_id in backends, finals
    for i in range(1, 1 + REJECTED):
        mine_rows = [r for r in rows if r.end_user_id == f"{tag}-{i}"]
        assert mine_rows and {(r.status, r.backend_id) for r in mine_rows} == {("no_route", "router")}, mine_rows
        assert all(r.provider_cost == 0 for r in mine_rows), mine_rows

    again = await served_again(ours, model, backends, tag)
    assert again and again[-1].ok and again[-1].backend in backends, [r.text for r in again]
    assert blamed(delta(await attempts(ours), before)) == {}


async def test_a_deployment_over_its_budget_is_skipped_and_blamed_for_nothing(budget_stack):
    """``provider-a`` (the cheaper, so kvroute's pick) spends its budget: LiteLLM's budget filter drops it and
    ``provider-b`` serves, with and without kvroute; after the window ``provider-a`` serves again."""
    ours, plain = budget_stack["ours"], budget_stack["plain"]
    before = await attempts(ours)
    bodies = [chat(f"skip {i}", model="hosted", user=f"skip-{i}") for i in range(8)]
    mine, theirs = await asyncio.gather(run(ours, bodies), run(plain, bodies))
    d = delta(await attempts(ours), before)
    assert [r.status for r in mine] == [r.status for r in theirs] == [200] * 8, [r.text for r in mine if not r.ok]
    assert mine[0].backend == "provider-a" and {r.backend for r in mine[2:]} == {"provider-b"}, mine
    assert blamed(d) == {}, d
    assert (await breakers(ours))["provider-a"] == "closed"
    rows = ledger_rows(budget_stack["ledger"], "skip-", 8)
    assert sorted((r.status, r.backend_id) for r in rows if r.is_final_attempt) == sorted(
        ("success", r.backend) for r in mine), rows
    assert not [r for r in rows if not r.is_final_attempt], rows  # no failed attempt booked on provider-a
    again = await served_again(ours, "hosted", {"provider-a"}, "skip")
    assert again[-1].ok and again[-1].backend == "provider-a", [r.text for r in again]


async def test_the_only_deployment_over_its_budget_is_a_router_rejection(budget_stack):
    await rejected_everywhere(budget_stack, "solo", "solo", {"solo-0"})


async def test_a_provider_over_its_budget_is_a_router_rejection(budget_stack):
    await rejected_everywhere(budget_stack, "capped", "capped", {"capped-0", "capped-1"})


def test_the_global_budget_rejects_after_the_pick_and_blames_nobody(tmp_path: Path):
    """``litellm_settings.max_budget`` already spent: the SDK raises ``BudgetExceededError`` after kvroute picked
    a replica (and LiteLLM tries the fallback group too); 422 with and without kvroute, nothing blamed, every
    breaker closed, the ledger books each rejection as ``no_route`` on ``router`` at no cost."""
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        cfgs = [stack_config(replicas.api_bases, hosted.api_bases, kvroute=kv) for kv in (True, False)]
        for cfg in cfgs:
            cfg["litellm_settings"]["max_budget"] = -1.0  # spent: LiteLLM's counter (0) exceeds it
        ours = es.enter_context(kvroute_proxy(cfgs[0], env={"KVROUTE_DATA_DIR": str(tmp_path)}))
        plain = es.enter_context(plain_proxy(cfgs[1]))

        async def go():
            before = await attempts(ours)
            bodies = [chat(f"global {i}", model=m, user=f"global-{m}-{i}") for i in range(REJECTED)
                      for m in ("llama", "hosted")]
            mine, theirs = await asyncio.gather(run(ours, bodies), run(plain, bodies))
            return mine, theirs, delta(await attempts(ours), before), await breakers(ours)

        mine, theirs, d, states = asyncio.run(go())
        assert [r.status for r in mine] == [r.status for r in theirs] == [422] * len(mine), [r.text for r in mine]
        assert all("Budget has been exceeded" in r.text for r in mine), mine[0].text
        assert blamed(d) == {}, d
        assert set(states.values()) == {"closed"}, states
        rows = ledger_rows(f"sqlite:///{tmp_path / 'billing.db'}", "global-", len(mine))
    finals = {r.end_user_id: r for r in rows if r.is_final_attempt}
    assert len(finals) == len(mine), rows
    assert {(r.status, r.backend_id) for r in rows} == {("no_route", "router")}, rows
    assert all(r.provider_cost == 0 for r in rows), rows


AUTH_MODULE = '''
from fastapi import HTTPException
from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth

BUDGETS = {"sk-poor": TINY, "sk-rich": None}


async def auth(request, api_key):
    key = (api_key or "").removeprefix("Bearer ").strip()
    if key == "MASTER_KEY":
        return UserAPIKeyAuth(api_key=key, user_role=LitellmUserRoles.PROXY_ADMIN)
    if key in BUDGETS:
        return UserAPIKeyAuth(api_key=key, token="tok-" + key, key_alias=key, max_budget=BUDGETS[key],
                              user_role=LitellmUserRoles.INTERNAL_USER)
    raise HTTPException(status_code=401, detail="unknown key")
'''


def test_a_key_over_its_budget_is_refused_at_auth_and_blames_nobody(tmp_path: Path):
    """The key ``sk-poor`` spends its budget on its first request; LiteLLM's auth refuses the next ones (422)
    with and without kvroute, before any routing: nothing blamed, breakers closed, no ledger row for them (never
    admitted, not usage; nor for a wrong key's 401s), and ``sk-rich`` is served by the backend that served
    ``sk-poor``."""
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=8)
    with contextlib.ExitStack() as es:
        replicas = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        proxies = []
        for kv in (True, False):
            cfg = stack_config(replicas.api_bases, hosted.api_bases, kvroute=kv, router={"num_retries": 0})
            for dep in cfg["model_list"]:
                if dep["model_info"]["id"] == "provider-a":
                    dep["litellm_params"].update(CHEAP)
                    dep["model_info"].update(CHEAP)
            cfg["general_settings"].update(custom_auth="budget_auth.auth", custom_auth_run_common_checks=True)
            workdir = tmp_path / ("ours" if kv else "plain")
            workdir.mkdir()
            (workdir / "budget_auth.py").write_text(
                AUTH_MODULE.replace("MASTER_KEY", cfg["general_settings"]["master_key"]).replace("TINY", repr(TINY)))
            env = {**OFFLINE_ENV, **({"KVROUTE_DATA_DIR": str(tmp_path / "data")} if kv else {})}
            proxies.append(es.enter_context(ProxyProcess(
                cfg, kvroute_settings=KVROUTE_SETTINGS if kv else None, env=env, workdir=workdir,
                inherit_kvroute_env=False)))
        ours, plain = proxies

        async def go(proxy: ProxyProcess, key: str, n: int, tag: str) -> list:
            async with httpx.AsyncClient(trust_env=False) as c:
                out = []
                for i in range(n):
                    out.append(await send(c, proxy, chat(f"{tag} {i}", model="hosted", user=f"{tag}-{i}"),
                                          headers={"Authorization": f"Bearer {key}"}))
                    await asyncio.sleep(0.3)  # the key's spend is counted after the reply
                return out

        async def both():
            before = await attempts(ours)
            poor = await asyncio.gather(go(ours, "sk-poor", 1 + REJECTED, "poor"),
                                        go(plain, "sk-poor", 1 + REJECTED, "poor"))
            wrong = await asyncio.gather(go(ours, "sk-wrong", 3, "wrong"), go(plain, "sk-wrong", 3, "wrong"))
            rich = await asyncio.gather(go(ours, "sk-rich", 2, "rich"), go(plain, "sk-rich", 2, "rich"))
            return poor, wrong, rich, delta(await attempts(ours), before), await breakers(ours)

        (mine, theirs), (wrong, wrong_plain), (rich, rich_plain), d, states = asyncio.run(both())
        assert [r.status for r in wrong] == [r.status for r in wrong_plain] == [401] * 3, [r.text for r in wrong]
        assert [r.status for r in mine] == [r.status for r in theirs] == [200] + [422] * REJECTED, \
            ([r.text for r in mine], [r.text for r in theirs])
        assert all("Budget has been exceeded" in r.text for r in mine[1:]), mine[1].text
        assert [r.status for r in rich] == [r.status for r in rich_plain] == [200, 200]
        assert mine[0].backend == "provider-a" and {r.backend for r in rich} == {"provider-a"}, (mine[0], rich)
        assert blamed(d) == {}, d
        assert set(states.values()) == {"closed"}, states
        rows = ledger_rows(f"sqlite:///{tmp_path / 'data' / 'billing.db'}", "", 3)
    served = sorted((r.end_user_id, r.status, r.backend_id) for r in rows if r.status == "success")
    assert served == [("poor-0", "success", "provider-a"), ("rich-0", "success", "provider-a"),
                      ("rich-1", "success", "provider-a")], rows
    assert [r for r in rows if r.status != "success"] == [], rows  # refused at auth: never admitted, not usage
