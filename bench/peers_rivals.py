"""The routers ``bench/peers.py`` compares, each started for real in front of the same fleet.

A rival is a chain of real processes: an optional LiteLLM proxy (with one routing strategy, or with kvroute's
callback) and an optional ``sglang-router`` (one policy, its defaults). With both, LiteLLM has one deployment,
the router, which spreads over the replicas: what a LiteLLM user deploys instead of kvroute.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_router import SglangRouter

from kvroute.plugin.proxy_process import ModelGroup, ProxyProcess, build_proxy_config


@dataclass(frozen=True)
class RivalSpec:
    """``sglang_policy``: an sglang-router in the path; ``litellm``: LiteLLM router_settings in front (None: none)."""

    key: str
    label: str
    sglang_policy: str | None = None
    litellm: Mapping[str, Any] | None = None
    kvroute: bool = False


RIVALS: tuple[RivalSpec, ...] = (
    RivalSpec("sglang-ca", "sglang-router cache_aware (direct)", sglang_policy="cache_aware"),
    RivalSpec("sglang-rr", "sglang-router round_robin (direct)", sglang_policy="round_robin"),
    RivalSpec("litellm-sglang-ca", "LiteLLM → sglang-router cache_aware", sglang_policy="cache_aware", litellm={}),
    RivalSpec("litellm-sglang-rr", "LiteLLM → sglang-router round_robin", sglang_policy="round_robin", litellm={}),
    RivalSpec("litellm-shuffle", "LiteLLM simple-shuffle", litellm={"routing_strategy": "simple-shuffle"}),
    RivalSpec("litellm-least-busy", "LiteLLM least-busy", litellm={"routing_strategy": "least-busy"}),
    RivalSpec("litellm-usage-v2", "LiteLLM usage-based-routing-v2",
              litellm={"routing_strategy": "usage-based-routing-v2"}),
    RivalSpec("litellm-session", "LiteLLM shuffle + session_affinity",
              litellm={"optional_pre_call_checks": ["session_affinity"]}),
    RivalSpec("litellm-deployment", "LiteLLM shuffle + deployment_affinity",
              litellm={"optional_pre_call_checks": ["deployment_affinity"]}),
    RivalSpec("kvroute", "LiteLLM + kvroute (cache_aware)", litellm={}, kvroute=True),
)
SHUFFLE, CHAIN, SGLANG = "litellm-shuffle", "litellm-sglang-ca", "sglang-ca"


@dataclass
class Rival:
    """A started rival: where to send requests and which processes do its routing work (for CPU per request)."""

    spec: RivalSpec
    base_url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    error: str | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def close(self) -> None:
        self._stack.close()


@dataclass(frozen=True)
class FleetView:
    """What a rival needs to know about the replicas."""

    api_bases: Sequence[str]
    model: str
    engine: str  # kvroute's model_info.engine: "vllm" (fake engines) or "llamacpp"
    capacity_tokens: int
    block_size: int | None


def _start(spec: RivalSpec, fleet: FleetView, sglang_binary: Path | None) -> Rival:
    rival = Rival(spec)
    try:
        if spec.sglang_policy:
            if sglang_binary is None:
                raise RuntimeError("no sglang-router executable")
            router = rival._stack.enter_context(SglangRouter(
                sglang_binary, [b.removesuffix("/v1") for b in fleet.api_bases], spec.sglang_policy))
            rival.base_url, rival.pids = router.base_url, [router.process.pid]
        if spec.litellm is not None:
            if spec.sglang_policy:  # one deployment: the router
                group = ModelGroup(fleet.model, [rival.base_url + "/v1"], model=fleet.model, engine=None,
                                   metrics=False, prices={"input_cost_per_token": 0.0, "output_cost_per_token": 0.0})
            else:
                group = ModelGroup(fleet.model, fleet.api_bases, model=fleet.model, engine=fleet.engine,
                                   kv_capacity_tokens=fleet.capacity_tokens, block_size=fleet.block_size)
            config = build_proxy_config([group], kvroute=spec.kvroute, router_settings=spec.litellm)
            proxy = rival._stack.enter_context(ProxyProcess(config, env={"LITELLM_LOG": "ERROR"},
                                                            inherit_kvroute_env=False))
            rival.base_url, rival.headers = proxy.base_url, proxy.headers
            rival.pids.append(proxy.process.pid)
    except Exception as exc:  # a rival that cannot start is reported, the others still run
        rival.close()
        rival.error = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    return rival


def start_rivals(specs: Sequence[RivalSpec], fleet: FleetView, sglang_binary: Path | None,
                 stack: contextlib.ExitStack) -> list[Rival]:
    """Start every rival, as many at a time as there are CPUs (a proxy takes seconds of CPU to import);
    ``stack`` stops them. The starting threads live until then: children get SIGTERM when the thread that
    spawned them ends (``PR_SET_PDEATHSIG`` follows the thread, not the process)."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(specs), os.cpu_count() or 2)))
    stack.callback(pool.shutdown)
    rivals = list(pool.map(lambda s: _start(s, fleet, sglang_binary), specs))
    for rival in rivals:
        stack.callback(rival.close)
    return rivals
