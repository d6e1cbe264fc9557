"""A hosted group whose only provider answered 429: kvroute must not fail requests the provider would serve.

Real LiteLLM proxies (one with kvroute, one without), each in front of its own hosted-style fake provider that
answers its next request 429 with a long ``Retry-After``. kvroute's breaker rests that provider for the
Retry-After; with every route of a hosted group resting, the one back soonest is still tried (the gateways'
bypass), so the client is served as it is without kvroute, instead of getting "no deployment" for certain.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PRICES = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
RETRY_AFTER_S = 10
BODY = {"model": "hosted", "max_tokens": 4, "messages": [{"role": "user", "content": "Are you resting? " * 20}]}


def statuses(kvroute: bool) -> tuple[int, int]:
    """Statuses of the request the fault meets (LiteLLM waits out the Retry-After, then retries it) and of one
    sent while that provider rests."""
    with Fleet(1, engine="fake", options=ReplicaOptions(capacity_tokens=8192)) as fleet:
        group = ModelGroup("hosted", fleet.api_bases, model=fleet.model, engine=None, prices=PRICES)
        with ProxyProcess(build_proxy_config([group], kvroute=kvroute), inherit_kvroute_env=False) as proxy:
            def send() -> int:
                return httpx.post(proxy.base_url + "/v1/chat/completions", json=BODY, headers=proxy.headers,
                                  timeout=120, trust_env=False).status_code

            def breaker() -> str:
                status = httpx.get(proxy.base_url + "/kvroute/status", headers=proxy.headers, timeout=10,
                                   trust_env=False).json()
                return status["backends"]["hosted-0"]["breaker"]

            fault = {"mode": "429", "count": 1, "retry_after": RETRY_AFTER_S}
            httpx.post(fleet.replicas[0].base_url + "/admin/fault", json=fault, timeout=10,
                       trust_env=False).raise_for_status()
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(send)
                deadline = time.monotonic() + RETRY_AFTER_S / 2
                while time.monotonic() < deadline and (breaker() != "open" if kvroute else faults_taken(fleet) < 1):
                    time.sleep(0.05)
                if kvroute:
                    assert breaker() == "open"  # kvroute heard the 429: the provider rests
                second = send()
                return first.result(), second


def faults_taken(fleet: Fleet) -> int:
    """Injected faults the fleet's one provider has served (its ``/admin/stats``)."""
    stats = httpx.get(fleet.replicas[0].base_url + "/admin/stats", timeout=10, trust_env=False).json()
    return sum(stats["faults"].values())


@pytest.mark.timeout(300)
def test_a_resting_only_provider_is_still_tried_as_without_kvroute():
    plain = statuses(kvroute=False)
    assert plain == (200, 200)  # the one sent meanwhile is served at once; the first after LiteLLM's wait
    assert statuses(kvroute=True) == plain
