"""A connection the engine closes as a request goes out: the retry goes back to the replica holding the prefix.

llama.cpp closes a keep-alive connection after 5 idle seconds; LiteLLM's pool keeps one for 15, so now and then a
request leaves on a connection the engine is closing and fails at once (``connection_lost``: a reset or disconnect
of an open connection, no answer). The engine is well, and it holds the conversation. Through a real proxy: one
fake replica holds a conversation and drops the next request's connection; LiteLLM retries, and kvroute sends the
retry back there (a cache hit), where before it went cold to the other replica. A second lost connection of the
same request is blamed as any failure (``RequestState.note_lost``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvroute.plugin.adapter.request_ids import RequestState
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

SYSTEM = "You are the house assistant; follow every rule of the handbook with care. " * 30


def test_a_request_goes_back_after_its_first_lost_connection_there_not_after_a_second():
    state = RequestState("r")
    assert state.note_lost("llama-0") is True
    assert state.note_lost("llama-1") is True
    assert state.note_lost("llama-0") is False


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_retry_of_a_dropped_connection_returns_to_the_holder(tmp_path):
    log = tmp_path / "decisions.jsonl"
    with Fleet(2, engine="fake", options=ReplicaOptions(capacity_tokens=16384)) as fleet:
        group = ModelGroup("llama", fleet.api_bases, model=fleet.model, kv_capacity_tokens=16384)
        config = build_proxy_config([group], kvroute=True)
        with ProxyProcess(config, env={"KVROUTE_DECISION_LOG": str(log)}, inherit_kvroute_env=False) as proxy:
            def send(messages: list[dict], call_id: str) -> httpx.Response:
                r = httpx.post(proxy.base_url + "/v1/chat/completions", timeout=120, trust_env=False,
                               json={"model": "llama", "max_tokens": 4, "messages": messages},
                               headers={**proxy.headers, "x-litellm-call-id": call_id})
                assert r.status_code == 200, r.text
                return r

            turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
            first = send(turns, "turn-1")
            holder = first.headers["x-litellm-model-id"]
            replica = fleet.replicas[int(holder.rsplit("-", 1)[1])]  # deployment ``llama-<i>``: the i-th replica
            assert fleet.api_bases[int(holder.rsplit("-", 1)[1])].startswith(replica.base_url)
            turns += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "second question"}]
            httpx.post(replica.base_url + "/admin/fault", json={"mode": "drop", "count": 1},
                       timeout=10, trust_env=False).raise_for_status()
            second = send(turns, "turn-2")
    assert second.headers["x-litellm-model-id"] == holder  # the retry went back to the prefix
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (ended,) = [e for e in lines if e.get("event") == "ended" and e.get("call_id") == "turn-2"]
    assert ended["verdict"] == "connection_lost" and ended["backend"] == holder and ended["blames_backend"]
    picks = [e for e in lines if "event" not in e and e.get("call_id") == "turn-2"]
    assert [p["backend"] for p in picks] == [holder, holder]

