"""A real kvroute proxy in front of fake replicas with its decision log on, and a chat sent through it by call id."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config


@contextlib.contextmanager
def logged_proxy(replicas: int, log: Path, capacity_tokens: int = 16384,
                 router_settings: dict[str, Any] | None = None) -> Iterator[tuple[Fleet, ProxyProcess]]:
    """``replicas`` fake engines (group ``llama``, deployments ``llama-<i>``) behind a kvroute proxy whose decision
    log is ``log`` (``router_settings``: over ``build_proxy_config``'s)."""
    with Fleet(replicas, engine="fake", options=ReplicaOptions(capacity_tokens=capacity_tokens)) as fleet:
        group = ModelGroup("llama", fleet.api_bases, model=fleet.model, kv_capacity_tokens=capacity_tokens)
        config = build_proxy_config([group], kvroute=True, router_settings=router_settings)
        with ProxyProcess(config, env={"KVROUTE_DECISION_LOG": str(log)}, inherit_kvroute_env=False) as proxy:
            yield fleet, proxy


def chat(proxy: ProxyProcess, messages: list[dict], call_id: str) -> httpx.Response:
    """One non-streamed chat to group ``llama`` with LiteLLM call id ``call_id``."""
    return httpx.post(proxy.base_url + "/v1/chat/completions", timeout=120, trust_env=False,
                      json={"model": "llama", "max_tokens": 4, "messages": messages},
                      headers={**proxy.headers, "x-litellm-call-id": call_id})


def fault(fleet: Fleet, index: int, mode: str, count: int = 1) -> None:
    """Replica ``index`` answers its next ``count`` requests with fault ``mode``."""
    httpx.post(fleet.replicas[index].base_url + "/admin/fault", json={"mode": mode, "count": count}, timeout=10,
               trust_env=False).raise_for_status()


def log_lines(log: Path, call_id: str) -> tuple[list[dict], list[dict]]:
    """(picks, endings) the decision log holds for ``call_id``, in order."""
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    mine = [line for line in lines if line.get("call_id") == call_id]
    return [e for e in mine if "event" not in e], [e for e in mine if e.get("event") == "ended"]
