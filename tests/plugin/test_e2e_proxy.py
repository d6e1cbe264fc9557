"""End to end: a real ``litellm`` proxy process with kvroute in front of fake replicas (and hosted fakes).

One kvroute proxy and one plain simple-shuffle proxy are shared by the whole module (startup is slow).
Assertions use cached-token counts and request outcomes, never wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from hooks_workload import run_conversations
from openai import AsyncOpenAI

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config.yaml"


def example_config(replica_bases: list[str], hosted_bases: list[str]) -> dict:
    """``examples/config.yaml`` as written, pointed at this test's backends (and quicker breaker/cooldowns)."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    template = next(d for d in cfg["model_list"] if d["model_name"] == "llama")
    hosted = [d for d in cfg["model_list"] if d["model_name"] == "hosted"]
    model_list = []
    for i, base in enumerate(replica_bases):
        dep = copy.deepcopy(template)
        dep["litellm_params"]["api_base"] = base
        dep["model_info"].update(id=f"replica-{i}", metrics_url=base.removesuffix("/v1") + "/metrics",
                                 kv_capacity_tokens=12000)
        model_list.append(dep)
    for i, (dep, base) in enumerate(zip(hosted, hosted_bases, strict=True)):
        dep = copy.deepcopy(dep)
        dep["litellm_params"]["api_base"] = base
        dep["model_info"]["id"] = f"h-{i}"
        model_list.append(dep)
    cfg["model_list"] = model_list
    cfg["router_settings"].update(cooldown_time=3, retry_after=0)
    cfg["kvroute"]["breaker"] = {"consecutive_failures": 3, "base_cooldown_s": 2.0, "max_cooldown_s": 4.0,
                                 "jitter": 0.0}
    return cfg


@pytest.fixture(scope="module")
def stack():
    """Fake replicas, hosted fakes and (when xllamacpp is installed) llama.cpp replicas behind two proxies."""
    from kvroute.plugin.dev.llamacpp import xllamacpp_available

    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=8)
    llama_opts = ReplicaOptions(threads=1, ctx=4096, parallel=1, cache_ram_mib=64)
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(Fleet(4, engine="fake", options=opts, name_prefix="rep"))
        hosted = stack.enter_context(Fleet(2, engine="fake", options=opts, name_prefix="host"))
        llamacpp = None
        if xllamacpp_available():
            llamacpp = stack.enter_context(Fleet(4, engine="llamacpp", options=llama_opts, name_prefix="lcpp",
                                                 start_timeout_s=120))
        cfg = example_config(replicas.api_bases, hosted.api_bases)
        groups = [ModelGroup("llama", replicas.api_bases, engine="vllm", id_prefix="replica")]
        if llamacpp is not None:
            tiny = ModelGroup("tiny", llamacpp.api_bases, model=llamacpp.model, engine="llamacpp")
            groups.append(tiny)
            cfg["model_list"] += tiny.deployments()
        base_cfg = build_proxy_config(groups, kvroute=False, router_settings=cfg["router_settings"] | {"fallbacks": []})
        ours = stack.enter_context(ProxyProcess(cfg))
        shuffle = stack.enter_context(ProxyProcess(base_cfg))
        yield {"replicas": replicas, "hosted": hosted, "llamacpp": llamacpp, "ours": ours, "shuffle": shuffle}


def client(proxy: ProxyProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=proxy.base_url + "/v1", api_key=proxy.master_key, max_retries=0, timeout=60,
                       http_client=httpx.AsyncClient(trust_env=False))


def sender(c: AsyncOpenAI, model: str = "llama"):
    async def send(messages):
        raw = await c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=4)
        resp = raw.parse()
        details = resp.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        return resp.choices[0].message.content, resp.usage.prompt_tokens, cached, raw.headers.get("x-litellm-model-id")
    return send


async def reset_caches(fleet: Fleet) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        for url in fleet.base_urls:
            await c.post(url + "/admin/reset")


async def fault(url: str, mode: str | None) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        if mode is None:
            await c.delete(url + "/admin/fault")
        else:
            await c.post(url + "/admin/fault", json={"mode": mode})


async def test_kvroute_gets_twice_the_cached_tokens_of_simple_shuffle(stack):
    await reset_caches(stack["replicas"])
    # 24 conversations: enough that simple-shuffle's lucky runs stay well under half of kvroute's hits
    base = await run_conversations(sender(client(stack["shuffle"])), conversations=24, turns=4, first_conv=0)
    await reset_caches(stack["replicas"])
    ours = await run_conversations(sender(client(stack["ours"])), conversations=24, turns=4, first_conv=500)
    print(f"\ncached-token share: kvroute {ours.share:.3f} vs simple-shuffle {base.share:.3f}; "
          f"kvroute spread {ours.backends}")
    assert base.failed == 0 and ours.failed == 0, (base.errors[:3], ours.errors[:3])
    assert ours.cached_tokens >= 2 * base.cached_tokens
    assert len(ours.backends) == 4


async def test_status_route_and_cli_show_backends(stack):
    proxy = stack["ours"]
    async with httpx.AsyncClient(trust_env=False) as c:
        status = (await c.get(proxy.base_url + "/kvroute/status", headers=proxy.headers)).json()
        metrics = (await c.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers)).text
    assert {"replica-0", "replica-1", "replica-2", "replica-3"} <= set(status["backends"])
    assert status["backends"]["replica-0"]["kind"] == "self_hosted"
    assert status["groups"]["llama"]["policy"] == "cache_aware"
    assert status["rules"] == ["batch-jobs", "agents"]  # the kvroute: block of the proxy's own config was read
    assert all(b["breaker"] in ("closed", "half_open", "open") for b in status["backends"].values())
    assert "kvroute_decisions_total" in metrics and "kvroute_confirmed_cached_tokens_total" in metrics
    out = subprocess.run([sys.executable, "-m", "kvroute.plugin.cli.cli", "status", "--proxy", proxy.base_url, "--json",
                          "--api-key", proxy.master_key],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["backends"].keys() == status["backends"].keys()


async def test_degraded_hosted_backend_loses_traffic_and_wins_it_back(stack):
    c = client(stack["ours"])
    send = sender(c, "hosted")
    cheap = stack["hosted"].base_urls[0]

    async def batch(n: int, tag: str) -> list[str | None]:
        seen = []
        for i in range(n):
            _, _, _, backend = await send([{"role": "user", "content": f"{tag} {i} " + "hosted words " * 50}])
            seen.append(backend)
        return seen

    before = await batch(6, "before")
    assert before.count("h-0") >= 5, before  # the cheaper provider wins when healthy
    await fault(cheap, "500")
    during = await batch(12, "during")  # every request still succeeds (retry/fallback to h-1)
    assert during[-6:].count("h-1") == 6, during
    await fault(cheap, None)
    deadline = time.monotonic() + 40
    after: list[str | None] = []
    while time.monotonic() < deadline:
        after += await batch(4, f"after{len(after)}")
        if after[-4:].count("h-0") == 4:
            break
        await asyncio.sleep(1.0)
    assert after[-4:].count("h-0") == 4, after


async def test_client_disconnect_mid_stream_releases_the_pick(stack):
    proxy = stack["ours"]
    urls = stack["replicas"].base_urls
    async with httpx.AsyncClient(trust_env=False) as c:
        for url in urls:
            await c.post(url + "/admin/fault", json={"mode": "slow_first_token", "delay_s": 1.5, "count": 1})
        try:
            body = {"model": "llama", "stream": True, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "disconnect me " * 200}]}
            with pytest.raises(httpx.ReadTimeout):
                async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, headers=proxy.headers,
                                    timeout=httpx.Timeout(10, read=0.5)) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
            deadline = time.monotonic() + 20
            status = {}
            while time.monotonic() < deadline:
                status = (await c.get(proxy.base_url + "/kvroute/status", headers=proxy.headers)).json()
                if status["pending"] == 0 and all(b["inflight"] == 0 for b in status["backends"].values()):
                    break
                await asyncio.sleep(0.25)
            assert status["pending"] == 0, status
            assert status["backends"] and all(b["inflight"] == 0 for b in status["backends"].values()), status
            metrics = (await c.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers)).text
            assert 'outcome="cancelled"' in metrics
        finally:
            for url in urls:
                await c.delete(url + "/admin/fault")


async def test_killing_one_of_four_replicas_mid_run_loses_no_request(stack):
    replicas = stack["replicas"]
    await reset_caches(replicas)

    async def kill_at(turn: int) -> None:
        if turn == 2:
            replicas.kill(1)

    try:
        tally = await run_conversations(sender(client(stack["ours"])), conversations=12, turns=4, first_conv=900,
                                        on_turn=kill_at)
    finally:
        replicas.restart(1)
    assert tally.failed == 0, tally
    assert tally.requests == 48
    assert tally.cached_tokens > 0


async def test_llamacpp_replicas_kvroute_gets_twice_the_cached_tokens(stack):
    st = stack
    if st["llamacpp"] is None:
        pytest.skip("xllamacpp is not installed (pip install 'kvroute[engines]')")
    # 16 conversations (48 requests) per run. simple-shuffle's share is random (0.17-0.35 over single runs of 16
    # here: one draw above half of kvroute's 0.66 was seen in CI), so it is the mean of four runs, each as long as
    # kvroute's run (the claim is about simple-shuffle's share, not one lucky draw of it)
    shuffled = [await run_conversations(sender(client(st["shuffle"]), "tiny"), conversations=16, turns=3,
                                        prompt_tokens=300, first_conv=first) for first in (0, 200, 300, 400)]
    ours = await run_conversations(sender(client(st["ours"]), "tiny"), conversations=16, turns=3,
                                   prompt_tokens=300, first_conv=100)
    base_share = sum(b.share for b in shuffled) / len(shuffled)
    print(f"\nllama.cpp cached-token share: kvroute {ours.share:.3f} vs simple-shuffle "
          f"{' / '.join(f'{b.share:.3f}' for b in shuffled)}; spread {ours.backends}")
    assert all(b.failed == 0 for b in shuffled) and ours.failed == 0, ([b.errors[:3] for b in shuffled],
                                                                       ours.errors[:3])
    assert ours.share >= 2 * base_share
