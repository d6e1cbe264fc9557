"""The routers ``bench/peers.py`` compares, each started for real in front of the same fleet.

A rival is a chain of real processes: an optional LiteLLM proxy (with one routing strategy, or with kvroute's
callback) and an optional Rust router (``peer_routers``: sglang-router 0.3.2, SMG 1.13, vllm-router 0.1.17; one
policy with its CLI defaults, plus the flags that turn on its session-sticky mode). With both, LiteLLM has one
deployment, the router, which spreads over the replicas: what a LiteLLM user deploys instead of kvroute.

Session keys: the replay sends each conversation's key as ``x-litellm-session-id`` (kvroute and LiteLLM's
session affinity) and ``x-session-id``. SMG's sticky sessions (``--sticky-sessions`` on ``cache_aware``, new keys
placed by ``cache_aware`` then pinned) read it through ``--routing-key-headers x-session-id``; vllm-router's
``sticky_least_loaded`` reads ``X-Session-ID`` first by default. Sticky modes run direct only: LiteLLM 1.110
does not forward client headers to a deployment unless told to, so behind it they would see no key.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer_routers import KINDS, SGLANG_ROUTER, SMG, VLLM_ROUTER, PeerRouter, RouterKind

from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config


@dataclass(frozen=True)
class RivalSpec:
    """``router``: a Rust router in the path (``peer_routers.KINDS`` key) with ``policy`` and ``router_args``;
    ``litellm``: LiteLLM router_settings in front (None: no LiteLLM)."""

    key: str
    label: str
    router: str | None = None
    policy: str = "cache_aware"
    router_args: tuple[str, ...] = ()
    litellm: Mapping[str, Any] | None = None
    kvroute: bool = False


_SMG_STICKY = ("--sticky-sessions", "--routing-key-headers", "x-session-id")
RIVALS: tuple[RivalSpec, ...] = (
    RivalSpec("sglang-ca", "sglang-router 0.3.2 cache_aware (direct)", router=SGLANG_ROUTER.key),
    RivalSpec("sglang-rr", "sglang-router 0.3.2 round_robin (direct)", router=SGLANG_ROUTER.key,
              policy="round_robin"),
    RivalSpec("litellm-sglang-ca", "LiteLLM → sglang-router cache_aware", router=SGLANG_ROUTER.key, litellm={}),
    RivalSpec("litellm-sglang-rr", "LiteLLM → sglang-router round_robin", router=SGLANG_ROUTER.key,
              policy="round_robin", litellm={}),
    RivalSpec("smg-ca", "SMG 1.13 cache_aware (direct)", router=SMG.key),
    RivalSpec("smg-sticky", "SMG 1.13 cache_aware + sticky sessions (direct)", router=SMG.key,
              router_args=_SMG_STICKY),
    RivalSpec("litellm-smg-ca", "LiteLLM → SMG cache_aware", router=SMG.key, litellm={}),
    RivalSpec("vllm-ca", "vllm-router 0.1.17 cache_aware (direct)", router=VLLM_ROUTER.key),
    RivalSpec("vllm-sll", "vllm-router 0.1.17 sticky_least_loaded (direct)", router=VLLM_ROUTER.key,
              policy="sticky_least_loaded"),
    RivalSpec("litellm-vllm-ca", "LiteLLM → vllm-router cache_aware", router=VLLM_ROUTER.key, litellm={}),
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
SHUFFLE = "litellm-shuffle"
# each peer's cache_aware direct and its LiteLLM chain: the targets compare kvroute with both
PEERS: dict[str, tuple[str, str]] = {"sglang-router": ("sglang-ca", "litellm-sglang-ca"),
                                     "smg": ("smg-ca", "litellm-smg-ca"),
                                     "vllm-router": ("vllm-ca", "litellm-vllm-ca")}


@dataclass
class Rival:
    """A started rival: where to send requests and which processes do its routing work (for CPU per request)."""

    spec: RivalSpec
    base_url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    error: str | None = None
    decision_log: Path | None = None  # kvroute's: one JSON line per pick (``KVROUTE_DECISION_LOG``)
    decisions_read: int = 0  # how far bench/peers.py has read it
    proxy_log: Path | None = None  # a LiteLLM proxy's own log (errors and retries are read from it)
    deployments: list[str] = field(default_factory=list)  # the ids of its LiteLLM deployments (warmed one by one)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def close(self) -> None:
        self._stack.close()

    def proxy_errors(self, limit: int = 20) -> list[str]:
        """The error lines of this rival's LiteLLM proxy log so far (at most ``limit``, each cut to 300
        characters): a retried or failed upstream call shows here, not in the answers."""
        if self.proxy_log is None or not self.proxy_log.exists():
            return []
        lines = self.proxy_log.read_text(encoding="utf-8", errors="replace").splitlines()
        return [line[:300] for line in lines if "error" in line.lower() or "exception" in line.lower()][:limit]


@dataclass(frozen=True)
class FleetView:
    """What a rival needs to know about the replicas."""

    api_bases: Sequence[str]
    model: str
    engine: str  # kvroute's model_info.engine: "vllm" (fake engines) or "llamacpp"
    capacity_tokens: int
    block_size: int | None


def _start(spec: RivalSpec, fleet: FleetView, binaries: Mapping[str, Path]) -> Rival:
    rival = Rival(spec)
    try:
        if spec.router:
            kind: RouterKind = KINDS[spec.router]
            if spec.router not in binaries:
                raise RuntimeError(f"no {kind.executable} executable ({kind.pin} not installed)")
            router = rival._stack.enter_context(PeerRouter(
                kind, binaries[spec.router], [b.removesuffix("/v1") for b in fleet.api_bases], spec.policy,
                spec.router_args))
            rival.base_url, rival.pids = router.base_url, [router.process.pid]
        if spec.litellm is not None:
            if spec.router:  # one deployment: the router
                group = ModelGroup(fleet.model, [rival.base_url + "/v1"], model=fleet.model, engine=None,
                                   metrics=False, prices={"input_cost_per_token": 0.0, "output_cost_per_token": 0.0})
            else:
                group = ModelGroup(fleet.model, fleet.api_bases, model=fleet.model, engine=fleet.engine,
                                   kv_capacity_tokens=fleet.capacity_tokens, block_size=fleet.block_size)
            config = build_proxy_config([group], kvroute=spec.kvroute, router_settings=spec.litellm)
            rival.deployments = [d["model_info"]["id"] for d in config["model_list"]]
            proxy = ProxyProcess(config, env={"LITELLM_LOG": "ERROR"}, inherit_kvroute_env=False)
            if spec.kvroute:  # the per-decision diff (bench/peers_diff.py) reads what each pick saw
                rival.decision_log = proxy.workdir / "decisions.jsonl"
                proxy.extra_env["KVROUTE_DECISION_LOG"] = str(rival.decision_log)
            proxy = rival._stack.enter_context(proxy)
            rival.base_url, rival.headers, rival.proxy_log = proxy.base_url, proxy.headers, proxy.log_path
            rival.pids.append(proxy.process.pid)
    except Exception as exc:  # a rival that cannot start is reported, the others still run
        rival.close()
        rival.error = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    return rival


def start_rivals(specs: Sequence[RivalSpec], fleet: FleetView, binaries: Mapping[str, Path],
                 stack: contextlib.ExitStack) -> list[Rival]:
    """Start every rival, as many at a time as there are CPUs (a proxy takes seconds of CPU to import);
    ``stack`` stops them. The starting threads live until then: children get SIGTERM when the thread that
    spawned them ends (``PR_SET_PDEATHSIG`` follows the thread, not the process). ``binaries``: each router's
    executable by ``RouterKind.key``."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(specs), os.cpu_count() or 2)))
    stack.callback(pool.shutdown)
    rivals = list(pool.map(lambda s: _start(s, fleet, binaries), specs))
    for rival in rivals:
        stack.callback(rival.close)
    return rivals
