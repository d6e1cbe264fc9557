"""A self-hosted group with a hosted fallback group behind a real LiteLLM proxy, and what tests read from it.

Used by the attribution, failover-matrix and fuzz tests: fault helpers, ``/kvroute/metrics`` attempt counts,
breaker states from ``/kvroute/status``, and a plain request sender that never raises.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

HOSTED_PRICES = ({"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6},
                 {"input_cost_per_token": 3e-6, "output_cost_per_token": 6e-6})
_ATTEMPT = re.compile(r'^kvroute_attempts_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def stack_config(replica_bases: Sequence[str], hosted_bases: Sequence[str], *, kvroute: bool = True,
                 router: Mapping[str, Any] | None = None, replica_params: Mapping[str, Any] | None = None) -> dict:
    """``llama`` (self-hosted replicas ``llama-i``) falling back to ``hosted`` (``provider-a``, ``provider-b``)."""
    groups = [ModelGroup("llama", list(replica_bases), engine="vllm", kv_capacity_tokens=12000)]
    cfg = build_proxy_config(groups, kvroute=kvroute, fallbacks=None,
                             router_settings={"num_retries": 1, "allowed_fails": 0, "cooldown_time": 3,
                                              "retry_after": 0, **(router or {})})
    for dep in cfg["model_list"]:
        dep["litellm_params"].update(replica_params or {})
    for i, base in enumerate(hosted_bases):
        name = f"provider-{'ab'[i]}"
        cfg["model_list"].append({
            "model_name": "hosted",
            "litellm_params": {"model": "openai/fake-model", "api_base": base, "api_key": "none", **HOSTED_PRICES[i]},
            "model_info": {"id": name, "provider": name, **HOSTED_PRICES[i]}})
    cfg["router_settings"]["fallbacks"] = [{"llama": ["hosted"]}]
    return cfg


KVROUTE_SETTINGS: dict[str, Any] = {
    "default_policy": "cache_aware",
    "groups": {"llama": {"policy": "cache_aware"}, "hosted": {"policy": "marketplace"}},
    "breaker": {"consecutive_failures": 3, "base_cooldown_s": 3.0, "max_cooldown_s": 6.0, "jitter": 0.0,
                "capacity_max_s": 10.0, "half_open_successes": 1},
}


# LiteLLM counts streamed tokens with a Hugging Face tokenizer it tries to download first; offline, its retries
# block the proxy's event loop for ~25 s on the first stream. Fail fast to tiktoken instead.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def plain_proxy(cfg: dict, env: Mapping[str, str] | None = None) -> ProxyProcess:
    return ProxyProcess(cfg, env={**OFFLINE_ENV, **(env or {})}, inherit_kvroute_env=False)


def kvroute_proxy(cfg: dict, redis_url: str | None = None, env: Mapping[str, str] | None = None,
                  **settings: Any) -> ProxyProcess:
    """A proxy with kvroute (``KVROUTE_SETTINGS`` updated by ``settings``); ``env`` adds variables, e.g.
    ``KVROUTE_DATA_DIR`` for the embedded ledger."""
    env = {**OFFLINE_ENV, **({"KVROUTE_REDIS_URL": redis_url} if redis_url else {}), **(env or {})}
    block = {**KVROUTE_SETTINGS, **settings}
    if redis_url:
        block["redis_namespace"] = f"kvr-test-{time.monotonic_ns()}"
        block.setdefault("hash_secret", "outcome-stack-secret-0123456789")
    return ProxyProcess(cfg, kvroute_settings=block, env=env, inherit_kvroute_env=False)


async def set_fault(url: str, mode: str | None, **params: Any) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
        if mode is None:
            await c.delete(url + "/admin/fault")
        else:
            r = await c.post(url + "/admin/fault", json={"mode": mode, **params})
            r.raise_for_status()


async def clear_faults(urls: Sequence[str]) -> None:
    await asyncio.gather(*(set_fault(u, None) for u in urls))


async def attempts(proxy: ProxyProcess) -> dict[tuple[str, str], float]:
    """``kvroute_attempts_total`` by (backend, outcome)."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        text = (await c.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers)).text
    out: dict[tuple[str, str], float] = {}
    for m in _ATTEMPT.finditer(text):
        labels = dict(_LABEL.findall(m["labels"]))
        out[(labels.get("backend", ""), labels.get("outcome", ""))] = float(m["value"])
    return out


def delta(after: Mapping[tuple[str, str], float], before: Mapping[tuple[str, str], float]) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


async def breakers(proxy: ProxyProcess) -> dict[str, str]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        status = (await c.get(proxy.base_url + "/kvroute/status", headers=proxy.headers)).json()
    return {name: b["breaker"] for name, b in status["backends"].items()}


async def wait_all_closed(proxy: ProxyProcess, timeout_s: float = 30.0) -> dict[str, str]:
    """Wait until every breaker reads closed (half-open ones are probed by a few requests)."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
        while time.monotonic() < deadline:
            states = await breakers(proxy)
            if all(s == "closed" for s in states.values()):
                return states
            for model in ("llama", "hosted"):
                await send(c, proxy, chat(f"probe {time.monotonic_ns()}", model=model))
            await asyncio.sleep(0.5)
    return states


def chat(text: str, model: str = "llama", max_tokens: int = 2, **extra: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}


@dataclass
class Reply:
    status: int
    backend: str | None
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200


async def send(c: httpx.AsyncClient, proxy: ProxyProcess, body: Any, *, headers: Mapping[str, str] | None = None,
               timeout: float = 30.0) -> Reply:
    """POST a chat completion; never raises (a transport error reads as status 0)."""
    hdrs = {**proxy.headers, **(headers or {})}
    try:
        if isinstance(body, bytes | str):
            r = await c.post(proxy.base_url + "/v1/chat/completions", content=body,
                             headers={"content-type": "application/json", **hdrs}, timeout=timeout)
        else:
            r = await c.post(proxy.base_url + "/v1/chat/completions", json=body, headers=hdrs, timeout=timeout)
    except httpx.HTTPError as exc:
        return Reply(0, None, f"{type(exc).__name__}: {exc}")
    return Reply(r.status_code, r.headers.get("x-litellm-model-id"), r.text[:500])


async def send_stream(c: httpx.AsyncClient, proxy: ProxyProcess, body: dict, timeout: float = 30.0) -> Reply:
    """A streamed chat completion read to the end; a stream that breaks or carries an error reads as failed."""
    try:
        async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json={**body, "stream": True},
                            headers=proxy.headers, timeout=timeout) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
            status = r.status_code
            backend = r.headers.get("x-litellm-model-id")
    except httpx.HTTPError as exc:
        return Reply(0, None, f"{type(exc).__name__}: {exc}")
    if status == 200 and ("data: [DONE]" not in text or '"error"' in text):
        status = 599  # the client saw a broken stream
    return Reply(status, backend, text[-500:])
