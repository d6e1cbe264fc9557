"""Run a real LiteLLM proxy process on a free 127.0.0.1 port from a generated config (e2e tests and the demo).

``build_proxy_config`` writes the ``model_list`` (replicas as one model group, optional hosted fallback group) with
either the kvroute callback or LiteLLM's plain ``simple-shuffle``; ``ProxyProcess`` starts ``litellm --config``,
waits for ``/health/readiness``, keeps its log, and always stops it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvroute.billing.settings import child_environment
from kvroute.plugin.dev.child_processes import (
    ChildOwner,
    spawn,
    start_with_port_retry,
    terminate,
    wait_until_ready,
)
from kvroute.policies.errors import ConfigError

KVROUTE_CALLBACK = "kvroute.plugin.kvroute_callback"
DEFAULT_MASTER_KEY = "sk-kvroute-local"


@dataclass(frozen=True)
class ModelGroup:
    """One LiteLLM model group: deployments at ``api_bases`` all serving ``model``.

    ``engine`` ("vllm", "llamacpp", ...) marks them as self-hosted replicas for kvroute; None means hosted.
    ``prices`` such as ``input_cost_per_token`` go to ``litellm_params``; self-hosted replicas without
    prices get an explicit 0 (their amortised cost lives in kvroute's rate card), which also spares
    LiteLLM its per-request zero-cost diagnostic over the whole cost map for an unknown model.
    """

    name: str
    api_bases: Sequence[str]
    model: str = "fake-model"
    engine: str | None = "vllm"
    id_prefix: str | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    metrics: bool = True
    prices: Mapping[str, float] = field(default_factory=dict)
    model_info: Mapping[str, Any] = field(default_factory=dict)

    def deployments(self) -> list[dict[str, Any]]:
        if not self.api_bases:
            raise ConfigError(f"model_list.{self.name}", "a model group needs at least one api_base")
        prefix = self.id_prefix or self.name
        out = []
        for i, api_base in enumerate(self.api_bases):
            params: dict[str, Any] = {"model": f"openai/{self.model}", "api_base": api_base, "api_key": "none"}
            if self.prices:
                params.update(self.prices)
            elif self.engine:
                params.update(input_cost_per_token=0, output_cost_per_token=0)
            info: dict[str, Any] = {"id": f"{prefix}-{i}", **self.model_info}
            if self.engine:
                info["engine"] = self.engine
                if self.kv_capacity_tokens:
                    info["kv_capacity_tokens"] = self.kv_capacity_tokens
                if self.block_size:
                    info["block_size"] = self.block_size
                if self.metrics:
                    info["metrics_url"] = api_base.rstrip("/").removesuffix("/v1") + "/metrics"
            out.append({"model_name": self.name, "litellm_params": params, "model_info": info})
        return out


def build_proxy_config(groups: Sequence[ModelGroup], *, kvroute: bool = True,
                       fallbacks: Mapping[str, Sequence[str]] | None = None,
                       master_key: str | None = DEFAULT_MASTER_KEY,
                       router_settings: Mapping[str, Any] | None = None,
                       litellm_settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A LiteLLM proxy config dict: kvroute's callback when ``kvroute``, else the plain simple-shuffle baseline."""
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ConfigError("model_list", f"duplicate model group names: {names}")
    model_list = [d for g in groups for d in g.deployments()]
    router: dict[str, Any] = {"routing_strategy": "simple-shuffle", "num_retries": 1, "allowed_fails": 1,
                              "cooldown_time": 5}
    if fallbacks:
        for src, dst in fallbacks.items():
            for name in (src, *dst):
                if name not in names:
                    raise ConfigError(f"router_settings.fallbacks.{src}", f"unknown model group {name!r}")
        router["fallbacks"] = [{src: list(dst)} for src, dst in fallbacks.items()]
    router.update(router_settings or {})
    settings: dict[str, Any] = {"drop_params": True}
    if kvroute:
        settings["callbacks"] = [KVROUTE_CALLBACK]
    settings.update(litellm_settings or {})
    config: dict[str, Any] = {"model_list": model_list, "litellm_settings": settings, "router_settings": router}
    if master_key:
        config["general_settings"] = {"master_key": master_key}
    return config


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def litellm_command() -> list[str]:
    """How to start the ``litellm`` CLI of this interpreter's environment."""
    exe = shutil.which("litellm", path=str(Path(sys.executable).parent))
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from litellm.proxy.proxy_cli import run_server; sys.exit(run_server())"]


class ProxyProcess(ChildOwner):
    """A ``litellm --config`` process on 127.0.0.1; ``with ProxyProcess(cfg) as proxy: proxy.base_url``.

    ``config`` is a config dict (written to the work directory) or the path of a config file, used as it is.

    ``kvroute_settings`` (the ``kvroute:`` block, e.g. ``{"groups": {"g": {"policy": "round_robin"}}}``) is written
    to its own YAML and passed as ``KVROUTE_CONFIG``; ``env`` adds variables for the proxy only;
    ``inherit_kvroute_env=False`` keeps this shell's other ``KVROUTE_*`` settings (Redis, billing DB) away from it.
    """

    def __init__(self, config: Mapping[str, Any] | Path, *, kvroute_settings: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, workdir: str | Path | None = None,
                 start_timeout_s: float = 180.0, port: int | None = None, inherit_kvroute_env: bool = True,
                 extra_args: Sequence[str] = ()) -> None:
        self.config_file = Path(config) if isinstance(config, Path) else None
        self.config = dict(yaml.safe_load(config.read_text()) if isinstance(config, Path) else config)
        self.extra_args = list(extra_args)  # more ``litellm`` CLI arguments, e.g. ["--num_workers", "4"]
        self.kvroute_settings = dict(kvroute_settings) if kvroute_settings is not None else None
        self.extra_env = dict(env or {})
        self.inherit_kvroute_env = inherit_kvroute_env
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvroute-proxy-"))
        self.start_timeout_s = start_timeout_s
        self.port = port or 0
        self._fixed_port = port is not None
        self.process = None
        self.config_path = self.config_file or self.workdir / "config.yaml"
        self.log_path = self.workdir / "proxy.log"

    @property
    def master_key(self) -> str | None:
        return (self.config.get("general_settings") or {}).get("master_key")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.master_key}"} if self.master_key else {}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in child_environment().items() if self.inherit_kvroute_env or not k.startswith("KVROUTE_")}
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        env.setdefault("LITELLM_LOG", "WARNING")
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["PYTHONUNBUFFERED"] = "1"
        if self.kvroute_settings is not None:
            path = self.workdir / "kvroute.yaml"
            path.write_text(yaml.safe_dump({"kvroute": self.kvroute_settings}, sort_keys=False))
            env["KVROUTE_CONFIG"] = str(path)
        env.update(self.extra_env)
        return env

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> ProxyProcess:
        """Write the config, start the proxy and wait until ``/health/readiness`` answers 200."""
        start_with_port_retry(self.launch, self._wait_ready, self.log_path, attempts=1 if self._fixed_port else 3)
        return self

    def launch(self) -> subprocess.Popen:
        """Write the config and spawn the proxy without waiting (``wait_ready`` waits); call from a thread that
        outlives the child (the child is told to stop when the thread that spawned it ends)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config_file is None:
            self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        if not self._fixed_port:
            self.port = free_port()
        self.process = spawn([*litellm_command(), "--config", str(self.config_path), "--host", "127.0.0.1",
                              "--port", str(self.port), *self.extra_args], self.log_path, env=self.env(),
                             cwd=self.workdir)
        return self.process

    def wait_ready(self) -> None:
        """Wait until the launched proxy answers ``/health/readiness`` (raises with its log tail if it dies)."""
        self._wait_ready()

    def _wait_ready(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            wait_until_ready(self.process, self.log_path,
                             lambda: client.get(self.base_url + "/health/readiness").status_code == 200,
                             what="litellm proxy", timeout_s=self.start_timeout_s)

    def stop(self) -> None:
        """Stop the proxy (SIGTERM, then SIGKILL); remove the work directory if this object created it."""
        if self.process is not None:
            terminate(self.process, timeout=10.0)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

