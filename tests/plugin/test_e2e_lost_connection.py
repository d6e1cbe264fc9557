"""A connection the engine closes as a request goes out: the retry goes back to the replica holding the prefix.

llama.cpp closes a keep-alive connection after 5 idle seconds; LiteLLM's pool keeps one for 15, so now and then a
request leaves on a connection the engine is closing and fails at once (``connection_lost``: a reset or disconnect
of an open connection, no answer). The engine is well, and it holds the conversation. Through a real proxy: one
fake replica holds a conversation and drops the next request's connection; LiteLLM retries, and kvroute sends the
retry back there (a cache hit), where before it went cold to the other replica. A second lost connection of the
same request is a failure like any other: the retry after it leaves (``RequestState.note_failed``).
"""

from __future__ import annotations

import pytest
from logged_proxy import chat, fault, log_lines, logged_proxy

from kvroute.plugin.adapter.request_ids import RequestState
from kvroute.policies.outcomes import FailureKind

SYSTEM = "You are the house assistant; follow every rule of the handbook with care. " * 30
LOST = FailureKind.CONNECTION_LOST


def test_a_request_avoids_a_backend_after_its_second_lost_connection_or_any_other_failure():
    state = RequestState("r")
    state.note_failed("llama-0", LOST)
    state.note_failed("llama-1", FailureKind.BACKEND_ERROR)
    assert state.failed == ["llama-1"]
    state.note_failed("llama-0", LOST)
    assert state.failed == ["llama-1", "llama-0"]
    state.note_failed("llama-2")
    assert state.failed == ["llama-1", "llama-0", "llama-2"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_retry_of_a_dropped_connection_returns_to_the_holder_once(tmp_path):
    log = tmp_path / "decisions.jsonl"
    # LiteLLM's own cooldown left out of the way (it would rest a replica after its second failure), two retries
    with logged_proxy(2, log, router_settings={"num_retries": 2, "allowed_fails": 100}) as (fleet, proxy):
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
        first = chat(proxy, turns, "turn-1")
        assert first.status_code == 200, first.text
        holder = first.headers["x-litellm-model-id"]  # ``llama-<i>``: the i-th replica
        index = int(holder.rsplit("-", 1)[1])
        other = f"llama-{1 - index}"

        turns += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "second question"}]
        fault(fleet, index, "drop")
        second = chat(proxy, turns, "turn-2")
        assert second.status_code == 200, second.text

        turns += [{"role": "assistant", "content": second.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "third question"}]
        fault(fleet, index, "drop", count=2)
        third = chat(proxy, turns, "turn-3")
        assert third.status_code == 200, third.text

    assert second.headers["x-litellm-model-id"] == holder  # the retry went back to the prefix
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    picks, (ended,) = log_lines(log, "turn-2")
    assert ended["verdict"] == "connection_lost" and ended["backend"] == holder and ended["blames_backend"]
    assert [p["backend"] for p in picks] == [holder, holder]

    picks, endings = log_lines(log, "turn-3")  # lost twice at the holder: the third try leaves
    assert [e["verdict"] for e in endings] == ["connection_lost", "connection_lost"]
    assert [p["backend"] for p in picks] == [holder, holder, other]
    assert third.headers["x-litellm-model-id"] == other
