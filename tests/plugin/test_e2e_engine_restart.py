"""A replica that comes back empty under a running proxy: kvroute must stop believing it holds what it held.

Real LiteLLM proxy with kvroute, two fake replicas exporting llama.cpp's metrics (``prompt_tokens_total`` only grows
while the engine lives), the decision log read back by call id. ``/admin/reset`` empties a replica's cache and its
counters, which is what a restarted llama.cpp shows its scraper.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRAPE_S = 0.1
SETTLE_S = 1.5  # fifteen scrape intervals: the scraper has read the replica since the last change


@pytest.mark.timeout(240)
def test_a_replica_emptied_under_a_running_proxy_is_routed_as_empty(tmp_path):
    """Before the reset the conversation's next turn matches its replica and the engine confirms the hit; after
    the replica comes back empty, the proxy's next pick believes no replica holds it, and the engine agrees
    (nothing cached). What the clients were told and what kvroute believed are compared request by request."""
    log = tmp_path / "decisions.jsonl"
    options = ReplicaOptions(capacity_tokens=8192, metrics_style="llamacpp")
    with Fleet(2, engine="fake", options=options) as fleet:
        group = ModelGroup("m", fleet.api_bases, model=fleet.model, engine="llamacpp", id_prefix="rep")
        env = {"KVROUTE_DECISION_LOG": str(log), "KVROUTE_METRICS_SCRAPE_INTERVAL_S": str(SCRAPE_S)}
        with ProxyProcess(build_proxy_config([group], kvroute=True), env=env, inherit_kvroute_env=False) as proxy:
            body = {"model": "m", "max_tokens": 4, "messages": [
                {"role": "system", "content": "You answer questions about the restart test. " * 60},
                {"role": "user", "content": "What holds the prefix?"}]}

            def send(call_id: str) -> int:
                r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                               headers={**proxy.headers, "x-litellm-call-id": call_id})
                assert r.status_code == 200, r.text
                details = r.json()["usage"].get("prompt_tokens_details") or {}
                return int(details.get("cached_tokens") or 0)

            def decision(call_id: str) -> dict:
                lines = [json.loads(line) for line in log.read_text().splitlines()]
                return next(d for d in lines if d["call_id"] == call_id)

            assert send("first") == 0
            time.sleep(SETTLE_S)
            seen_hit = send("again")
            again = decision("again")
            holder = again["backend"]
            assert again["reason"] == "prefix_match" and again["matched_tokens"] > 0 and seen_hit > 0
            time.sleep(SETTLE_S)  # the scraper reads the holder's counter with both requests in it

            index = int(holder.rsplit("-", 1)[1])
            httpx.post(fleet.replicas[index].base_url + "/admin/reset", timeout=10, trust_env=False).raise_for_status()
            time.sleep(SETTLE_S)
            seen_after = send("after")
            after = decision("after")
    assert after["matched_tokens"] == 0 and after["reason"] != "prefix_match"  # believed held nowhere
    assert seen_after == 0  # and nowhere was it: the emptied holder, or the replica that never had it
