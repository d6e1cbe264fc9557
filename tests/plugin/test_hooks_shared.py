"""Two plugin instances (two proxy workers) sharing prefix index and breakers through a real Redis."""

from __future__ import annotations

import time
import uuid

from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings


def deps(n: int = 4) -> list[dict]:
    return [{"model_name": "llama", "litellm_params": {"model": "openai/m", "api_base": f"http://h{i}/v1"},
             "model_info": {"id": f"r{i}", "engine": "vllm"}} for i in range(n)]


def finish_all(cb: KvrouteCallback) -> None:
    """Complete every routed request (as the success hook would), so load does not steer the next pick."""
    for rid, ticket in list(cb.tickets.items()):
        ticket.router.on_complete(rid, cached_tokens=0)


def wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_workers_agree_on_prefix_holders_and_breakers(redis_url):
    ns = f"kvtest-{uuid.uuid4().hex[:8]}"
    settings = KvrouteSettings(redis_url=redis_url, redis_namespace=ns, breaker={"consecutive_failures": 1},
                               hash_secret="two-workers-secret-0123456789")
    a = KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)
    b = KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)
    try:
        msgs = [{"role": "system", "content": "shared prefix " * 300}, {"role": "user", "content": "q"}]
        chosen = a.filter("llama", deps(), msgs, {"metadata": {}})[0]["model_info"]["id"]
        finish_all(a)
        assert a.shared is not None and a.routers["llama"].index.__class__.__name__ == "SharedPrefixIndex"
        b.filter("llama", deps(), [{"role": "user", "content": "warm up " * 300}], {"metadata": {}})
        finish_all(b)
        router_b = b.routers["llama"]
        keys = router_b.fingerprint({"messages": msgs}, model="llama").keys
        assert wait_for(lambda: router_b.index.match(keys, [chosen], router_b.clock()).get(chosen, 0) > 0)
        for _ in range(3):  # worker B sends the same prefix where worker A put it
            assert b.filter("llama", deps(), msgs, {"metadata": {}})[0]["model_info"]["id"] == chosen
            finish_all(b)
        a.health.record("r3", "provider_failure", a.clock())
        assert a.health.state("r3", a.clock()) == "open"
        assert wait_for(lambda: b.health.state("r3", b.clock()) == "open")
    finally:
        for cb in (a, b):
            if cb.shared is not None:
                cb.shared.close()
