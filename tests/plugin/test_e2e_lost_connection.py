"""A connection the engine closes as a request goes out: the retry goes back to the replica holding the prefix.

llama.cpp closes a keep-alive connection after 5 idle seconds; LiteLLM's pool keeps one for 15, so now and then a
request leaves on a connection the engine is closing and fails at once (``connection_lost``: a reset or disconnect
of an open connection, no answer). The engine is well, and it holds the conversation. Through a real proxy: one
fake replica holds a conversation and drops the next request's connection; LiteLLM retries, and kvroute sends the
retry back there (a cache hit), where before it went cold to the other replica. A second lost connection of the
same request is blamed as any failure (``RequestState.note_lost``).
"""

from __future__ import annotations

import pytest
from logged_proxy import chat, fault, log_lines, logged_proxy

from kvroute.plugin.adapter.request_ids import RequestState

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
    with logged_proxy(2, log) as (fleet, proxy):
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
        first = chat(proxy, turns, "turn-1")
        assert first.status_code == 200, first.text
        holder = first.headers["x-litellm-model-id"]  # ``llama-<i>``: the i-th replica
        turns += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "second question"}]
        fault(fleet, int(holder.rsplit("-", 1)[1]), "drop")
        second = chat(proxy, turns, "turn-2")
        assert second.status_code == 200, second.text
    assert second.headers["x-litellm-model-id"] == holder  # the retry went back to the prefix
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    picks, (ended,) = log_lines(log, "turn-2")
    assert ended["verdict"] == "connection_lost" and ended["backend"] == holder and ended["blames_backend"]
    assert [p["backend"] for p in picks] == [holder, holder]
