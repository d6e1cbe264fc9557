"""The fake engine's vLLM token endpoints: /tokenize, /detokenize and the render endpoints, shapes and consistency."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.plugin.dev.fake_cache import token_count
from kvroute.plugin.dev.fake_engine import FakeEngineConfig, FakeEngineServer, render_chat
from kvroute.plugin.dev.fake_tokens import detokenize, token_ids

CHAT = {"model": "fake-model", "max_tokens": 3,
        "messages": [{"role": "system", "content": "You answer briefly. " * 20},
                     {"role": "user", "content": "hello there"}]}


@given(st.text(max_size=200))
def test_ids_count_like_the_cache_and_invert(text):
    ids = token_ids(text)
    assert len(ids) == token_count(text)
    assert all(0 <= i < 2 ** 32 for i in ids)
    assert detokenize(ids) == text.rstrip("\0").encode("utf-8", "surrogatepass").decode("utf-8", "replace")


@given(st.text(max_size=100), st.text(max_size=100))
def test_a_prompt_starts_with_the_ids_of_its_token_aligned_prefixes(head, tail):
    cut = len(head.encode("utf-8", "surrogatepass")) // 4 * 4
    prefix = head.encode("utf-8", "surrogatepass")[:cut]
    whole = head + tail
    assert token_ids(whole)[:cut // 4] == [int.from_bytes(prefix[i:i + 4], "little") for i in range(0, cut, 4)]


@pytest.fixture
async def client():
    async with FakeEngineServer(FakeEngineConfig(max_model_len=4096)) as server, \
            httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
        yield c


async def test_tokenize_prompt_and_messages_like_vllm(client):
    r = await client.post("/tokenize", json={"model": "fake-model", "prompt": "abcdefgh"})
    assert r.status_code == 200
    assert r.json() == {"count": 2, "max_model_len": 4096, "tokens": token_ids("abcdefgh"), "token_strs": None}
    r = await client.post("/tokenize", json={**CHAT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == token_ids(render_chat(CHAT["messages"]))
    assert body["count"] == len(body["tokens"]) and "".join(body["token_strs"]) == render_chat(CHAT["messages"])
    no_prompt = await client.post("/tokenize", json={**CHAT, "add_generation_prompt": False})
    assert body["tokens"][:len(no_prompt.json()["tokens"]) - 1] == no_prompt.json()["tokens"][:-1]
    assert no_prompt.json()["count"] < body["count"]


async def test_chat_render_matches_the_prompt_the_engine_prefills(client):
    r = await client.post("/v1/chat/completions/render", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    assert set(body) >= {"request_id", "token_ids", "features", "sampling_params", "model", "stream"}
    assert body["request_id"].startswith("chatcmpl-") and body["sampling_params"] == {"max_tokens": 3}
    served = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert len(body["token_ids"]) == served["usage"]["prompt_tokens"]  # the same tokens the engine counts
    stats = (await client.get("/admin/stats")).json()
    assert stats["completions"] == 1 and stats["prompt_tokens"] == served["usage"]["prompt_tokens"]  # no prefill
    assert stats["token_calls"] == {"/v1/chat/completions/render": 1}


async def test_completion_render_is_a_list_and_detokenize_inverts(client):
    r = await client.post("/v1/completions/render", json={"model": "fake-model", "prompt": ["abcd", "efghij"]})
    assert [item["token_ids"] for item in r.json()] == [token_ids("abcd"), token_ids("efghij")]
    r = await client.post("/detokenize", json={"model": "fake-model", "tokens": token_ids("efghij")})
    assert r.json() == {"prompt": "efghij"}


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "m"}), ("/tokenize", [1]),
                                        ("/v1/chat/completions/render", {"messages": []}),
                                        ("/v1/completions/render", {"prompt": 3}),
                                        ("/detokenize", {"tokens": ["x"]})])
async def test_bad_token_requests_get_vllms_400(client, path, body):
    r = await client.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400 and r.json()["error"]["message"]
