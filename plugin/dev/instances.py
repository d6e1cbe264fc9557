"""Several LiteLLM proxy instances with kvroute sharing one Redis: separate ``litellm --config`` processes on their
own 127.0.0.1 ports, as a plain load balancer would see them (scale-out tests and ``bench/scale_out.py``).

``ProxyInstances(config, 4, redis_url=...)`` writes one proxy config per instance (the same ``model_list`` and
``kvroute:`` block, with ``redis_url``, ``redis_namespace`` and ``hash_secret`` set), starts them in parallel,
and always stops them. ``kill(i)`` is a crash (SIGKILL, no flush); ``restart(i)`` starts the same instance again
on its port. ``status(i)`` and ``decisions(i)`` read kvroute's own routes on that instance.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import httpx

from kvroute.plugin.dev.child_processes import ChildOwner, kill
from kvroute.plugin.dev.proxy_process import ProxyProcess

_DECISION = re.compile(r'^kvroute_decisions_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def shared_config(config: Mapping[str, Any], *, redis_url: str, namespace: str, hash_secret: str) -> dict[str, Any]:
    """``config`` with its ``kvroute:`` block pointed at the shared Redis (``hash_secret`` set explicitly, so every
    instance keys prefixes alike whatever Redis holds)."""
    cfg = copy.deepcopy(dict(config))
    block = dict(cfg.get("kvroute") or {})
    block.update(redis_url=redis_url, redis_namespace=namespace, hash_secret=hash_secret)
    cfg["kvroute"] = block
    return cfg


class ProxyInstances(ChildOwner):
    """``n`` proxy processes with one config; ``with ProxyInstances(cfg, 4, ...) as fleet: fleet.base_urls``."""

    def __init__(self, config: Mapping[str, Any], n: int, *, redis_url: str, namespace: str, hash_secret: str,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 240.0) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        self.config = shared_config(config, redis_url=redis_url, namespace=namespace, hash_secret=hash_secret)
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.proxies: list[ProxyProcess] = [self._new() for _ in range(n)]

    def _new(self, port: int | None = None) -> ProxyProcess:
        return ProxyProcess(self.config, env=self.env, start_timeout_s=self.start_timeout_s, port=port,
                            inherit_kvroute_env=False)

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> ProxyInstances:
        """Start every instance at once (startup is mostly import time) and wait until all are ready."""
        self._start_many(self.proxies)
        return self

    @staticmethod
    def _start_many(proxies: list[ProxyProcess]) -> None:
        """Spawn all from this thread (a child is stopped when the thread that spawned it ends), then wait for
        each; one that did not come up (a port taken meanwhile) gets one ordinary start."""
        for p in proxies:
            p.launch()
        for p in proxies:
            try:
                p.wait_ready()
            except Exception:
                p.stop()
                p.start()

    def add(self) -> int:
        """Start one more instance (a late joiner); returns its index."""
        proxy = self._new()
        proxy.start()
        self.proxies.append(proxy)
        return len(self.proxies) - 1

    def kill(self, i: int) -> None:
        """SIGKILL instance ``i`` (its process group): nothing is flushed, its Redis heartbeat just stops."""
        proc = self.proxies[i].process
        if proc is not None:
            kill(proc)

    def restart(self, i: int) -> None:
        """Start instance ``i`` again on the same port (after ``kill``)."""
        old = self.proxies[i]
        old.stop()
        self.proxies[i] = self._new(port=old.port)
        self.proxies[i].start()

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()

    # --- what an operator can read -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.proxies)

    @property
    def base_urls(self) -> list[str]:
        return [p.base_url for p in self.proxies]

    @property
    def master_key(self) -> str | None:
        return self.proxies[0].master_key

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.proxies if p.process is not None]

    def status(self, i: int, timeout: float = 10.0) -> dict[str, Any]:
        """Instance ``i``'s ``/kvroute/status`` JSON."""
        p = self.proxies[i]
        r = httpx.get(p.base_url + "/kvroute/status", headers=p.headers, timeout=timeout, trust_env=False)
        r.raise_for_status()
        return r.json()

    def decisions(self, i: int, group: str | None = None, timeout: float = 10.0) -> dict[str, float]:
        """Instance ``i``'s decision counts by reason (``prefix_match``, ``cold``, ...), from ``/kvroute/metrics``."""
        p = self.proxies[i]
        r = httpx.get(p.base_url + "/kvroute/metrics", headers=p.headers, timeout=timeout, trust_env=False)
        r.raise_for_status()
        return parse_decisions(r.text, group)


def parse_decisions(text: str, group: str | None = None) -> dict[str, float]:
    """``kvroute_decisions_total`` summed by reason (optionally for one group) from Prometheus text."""
    out: dict[str, float] = {}
    for labels, value in _DECISION.findall(text):
        tags = dict(_LABEL.findall(labels))
        if group is not None and tags.get("group") != group:
            continue
        reason = tags.get("reason", "")
        out[reason] = out.get(reason, 0.0) + float(value)
    return out
