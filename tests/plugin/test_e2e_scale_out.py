"""Four proxy instances, not four workers: separate ``litellm --config`` processes on their own ports (the example
config pointed at fake engines), one redis-server this module owns, clients spraying a multi-turn shared-prefix
workload at random over the instances. Cached shares come from the engines' own counters; agreement from each
instance's decision counters and the serving deployment; Redis and one instance are killed and restarted.

Figures are printed (``-s``); assertions are ratios within one run and step counts, never wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from loopback import REDIS, RedisServer

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.instances import ProxyInstances
from kvroute.plugin.dev.spray import SprayPlan, engine_tokens, send_chat, spray, system_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config.yaml"
HASH_SECRET = "scale-out-e2e-hash-secret-0123456789"  # set explicitly: every instance keys prefixes alike
DEAD_REPLICA = "replica-2"
#: Status polls (0.1 s apart) a restarted instance may take after readiness to hold the index and breakers
#: its peers hold: generous against the 0-2 measured here (it replays the stream while it starts).
CATCH_UP_POLLS = 100


def scale_config(replica_bases: list[str], hosted_bases: list[str]) -> dict:
    """``examples/config.yaml`` pointed at this module's engines; breakers stay open long enough to be caught up."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    template = next(d for d in cfg["model_list"] if d["model_name"] == "llama")
    hosted = [d for d in cfg["model_list"] if d["model_name"] == "hosted"]
    model_list = []
    for i, base in enumerate(replica_bases):
        dep = copy.deepcopy(template)
        dep["litellm_params"]["api_base"] = base
        dep["model_info"].update(id=f"replica-{i}", metrics_url=base.removesuffix("/v1") + "/metrics")
        model_list.append(dep)
    for dep, base in zip(hosted, hosted_bases, strict=True):
        dep = copy.deepcopy(dep)
        dep["litellm_params"]["api_base"] = base
        model_list.append(dep)
    cfg["model_list"] = model_list
    cfg["kvroute"]["breaker"] = {"consecutive_failures": 3, "base_cooldown_s": 300.0, "max_cooldown_s": 600.0,
                                 "jitter": 0.0}
    return cfg


@pytest.fixture(scope="module")
def stack():
    if REDIS is None:
        pytest.skip("the scale-out e2e needs the redis-server binary (it kills and restarts it)")
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=20000, decode_ms=1.0, slots=8)
    server = RedisServer(REDIS)
    server.start()
    with contextlib.ExitStack() as es:
        es.callback(server.stop)
        replicas = es.enter_context(Fleet(3, engine="fake", options=opts, name_prefix="rep"))
        hosted = es.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        cfg = scale_config(replicas.api_bases, hosted.api_bases)
        fleet = es.enter_context(ProxyInstances(cfg, 4, redis_url=server.url, namespace=f"e2e-{uuid.uuid4().hex[:6]}",
                                                hash_secret=HASH_SECRET))
        yield {"redis": server, "replicas": replicas, "fleet": fleet}


def engines(stack) -> list[str]:
    return stack["replicas"].base_urls


async def reset(stack) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        for url in engines(stack):
            await c.post(url + "/admin/reset")


async def share_of(stack, plan: SprayPlan, pick=None, after_each=None):
    before = await engine_tokens(engines(stack))
    result = await spray(stack["fleet"].base_urls, stack["fleet"].master_key, plan, pick=pick, after_each=after_each)
    after = await engine_tokens(engines(stack))
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return result, (cached / prompt if prompt else 0.0)


def probe_messages(probe: int, turn: int) -> list[dict]:
    msgs = [{"role": "system", "content": system_text(90_000 + probe, 1000)}]
    for t in range(turn):
        msgs += [{"role": "user", "content": f"probe {probe} turn {t}"}, {"role": "assistant", "content": "ok"}]
    return [*msgs, {"role": "user", "content": f"probe {probe} turn {turn}"}]


async def send_to(fleet: ProxyInstances, i: int, messages: list[dict]) -> str | None:
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
        _, _, backend = await send_chat(c, fleet.base_urls[i], fleet.master_key, "llama", messages, 4)
    return backend


MISSES: list[str] = []


async def decide(fleet: ProxyInstances, j: int, messages: list[dict], holder: str | None) -> tuple[str, str | None]:
    """Instance ``j`` sends ``messages``: ``match`` (to ``holder``, counted ``prefix_match``), ``spill`` (it knew a
    holder but load moved the request: ``prefix_spill``) or ``miss`` (anything else, noted in ``MISSES``); with the
    replica that served it."""
    before = fleet.decisions(j, "llama")
    backend = await send_to(fleet, j, messages)
    after = fleet.decisions(j, "llama")
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    if backend == holder and delta.get("prefix_match", 0) == 1:
        return "match", backend
    MISSES.append(f"instance {j}: {backend} (holder {holder}), decisions {delta}")
    return ("spill" if delta.get("prefix_spill", 0) == 1 else "miss"), backend


async def follows(fleet: ProxyInstances, j: int, messages: list[dict], holder: str | None) -> bool:
    return (await decide(fleet, j, messages, holder))[0] == "match"


async def test_four_instances_keep_one_instances_cached_share(stack):
    fleet = stack["fleet"]
    plan = SprayPlan(conversations=16, systems=3, turns=4, clients=4, system_tokens=1000)
    await reset(stack)
    one, share_one = await share_of(stack, plan, pick=lambda _rng: 0)
    await reset(stack)
    four, share_four = await share_of(stack, SprayPlan(**{**plan.__dict__, "first_conv": 1000, "seed": 2}))
    print(f"\ncached share: one instance {share_one:.3f}, four instances {share_four:.3f} "
          f"({share_four / share_one:.3f}x); per instance {sorted(four.per_instance.items())}; "
          f"TTFT p50 {one.percentile(0.5):.3f}/{four.percentile(0.5):.3f} s")
    assert one.failed == 0 and four.failed == 0, one.errors + four.errors
    assert len(four.per_instance) == len(fleet) and min(four.per_instance.values()) >= 4
    assert share_one > 0.5
    assert share_four >= 0.97 * share_one


async def test_a_prefix_sent_to_one_instance_is_a_match_on_every_other(stack):
    fleet = stack["fleet"]
    outcomes: list[str] = []
    for probe in range(4):
        holder = await send_to(fleet, probe % len(fleet), probe_messages(probe, 0))
        await asyncio.sleep(0.3)  # replication takes tens of milliseconds (status: shared_state.replication)
        for j in range(len(fleet)):
            if j != probe % len(fleet):
                outcome, served = await decide(fleet, j, probe_messages(probe, 1 + j), holder)
                outcomes.append(outcome)
                # Each follow-up extends the last, so whoever served it holds the longest prefix: after a spill
                # that is the new replica, and the next instance's longest match is there.
                holder = served
                await asyncio.sleep(0.3)
    agreed, total = outcomes.count("match"), len(outcomes)
    lags = [fleet.status(i)["shared_state"]["replication"] for i in range(len(fleet))]
    print(f"\nagreement {agreed}/{total}; replication lag p50/p90 per instance: "
          f"{[(lag['lag_p50_s'], lag['lag_p90_s']) for lag in lags]}; misses {MISSES}")
    # Every instance knows the holder (no cold pick). On this shared 2-core box one follow-up in 12 was once moved
    # by load (a ``prefix_spill``: the policy's call, the index agreed); more than one would be a disagreement.
    assert "miss" not in outcomes, MISSES
    assert agreed >= total - 1, MISSES


async def test_redis_restart_mid_run_loses_no_request_and_rebuilds_state(stack):
    fleet, server = stack["fleet"], stack["redis"]
    before_restart = await send_to(fleet, 1, probe_messages(100, 0))  # known only from before the restart
    outage = {}

    async def faults(n: int) -> None:
        if n == 16:
            await asyncio.to_thread(server.stop)
            outage["down_at"] = n
        elif n == 32:
            await asyncio.to_thread(server.start)  # same port, empty: no persistence
            outage["up_at"] = n

    plan = SprayPlan(conversations=12, systems=3, turns=4, clients=3, first_conv=3000, seed=3)
    result, share = await share_of(stack, plan, after_each=faults)
    print(f"\nredis restart mid-run: {result.requests} requests, {result.failed} failed, cached share {share:.3f}, "
          f"outage between requests {outage}")
    assert outage == {"down_at": 16, "up_at": 32}
    assert result.failed == 0, result.errors

    r = redis.Redis.from_url(server.url)
    ns = fleet.config["kvroute"]["redis_namespace"]
    polls = 0
    while polls < 300:  # every worker re-registers on its next heartbeat after the restart
        states = [fleet.status(i)["shared_state"] for i in range(len(fleet))]
        if (all(s["connected"] for s in states) and sum(s["reseeds"] for s in states) == 1
                and r.zcard(f"{ns}:workers") == len(fleet)):
            break
        polls += 1
        await asyncio.sleep(0.1)
    print(f"reconnected and re-seeded after {polls} status polls; reseeds per instance "
          f"{[s['reseeds'] for s in states]}")
    assert all(s["connected"] for s in states) and sum(s["reseeds"] for s in states) == 1
    assert r.xlen(f"{ns}:prefix") > 0 and r.zcard(f"{ns}:workers") == len(fleet) and r.get(f"{ns}:epoch")
    r.close()

    after_restart = await send_to(fleet, 2, probe_messages(101, 0))
    await asyncio.sleep(0.3)
    assert await follows(fleet, 3, probe_messages(101, 1), after_restart)
    late = fleet.add()  # an instance started after the restart (from this thread, as above)
    await asyncio.sleep(0.3)
    assert await follows(fleet, late, probe_messages(100, 1), before_restart)
    assert await follows(fleet, late, probe_messages(101, 2), after_restart)


async def test_killed_instance_catches_up_on_index_and_breakers(stack):
    fleet, replicas = stack["fleet"], stack["replicas"]
    dead = replicas.base_urls[int(DEAD_REPLICA.rsplit("-", 1)[1])]
    async with httpx.AsyncClient(trust_env=False) as c:
        await c.post(dead + "/admin/fault", json={"mode": "500"})
    try:
        for n in range(60):  # cold prompts rotate over the replicas until the faulty one's breaker opens
            with contextlib.suppress(Exception):
                await send_to(fleet, n % len(fleet), probe_messages(200 + n, 0))
            if fleet.status(n % len(fleet))["backends"][DEAD_REPLICA]["breaker"] == "open":
                break
        await asyncio.sleep(0.5)
        assert all(fleet.status(i)["backends"][DEAD_REPLICA]["breaker"] == "open" for i in range(len(fleet)))
        holder = await send_to(fleet, 0, probe_messages(300, 0))
        peer_blocks = sum(b["index_blocks"] for b in fleet.status(0)["backends"].values())

        fleet.kill(1)
        t0 = time.monotonic()
        fleet.restart(1)  # from this thread: a child is stopped when the thread that spawned it ends
        ready_s = time.monotonic() - t0
        polls = 0
        while polls < CATCH_UP_POLLS:
            st = fleet.status(1)
            blocks = sum(b["index_blocks"] for b in st["backends"].values())
            if st["backends"][DEAD_REPLICA]["breaker"] == "open" and st["shared_state"]["connected"] and blocks:
                break
            polls += 1
            await asyncio.sleep(0.1)
        caught_s = time.monotonic() - t0
        print(f"\nkill -9 + restart: ready after {ready_s:.1f} s, index and breakers caught up {polls} polls after "
              f"readiness ({caught_s:.1f} s from restart); index blocks {blocks} vs a peer's {peer_blocks}")
        assert polls < CATCH_UP_POLLS
        assert await follows(fleet, 1, probe_messages(300, 1), holder)
    finally:
        async with httpx.AsyncClient(trust_env=False) as c:
            await c.delete(dead + "/admin/fault")
