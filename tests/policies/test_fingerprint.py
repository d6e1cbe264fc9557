"""Fingerprints: canonical, deterministic across processes, salted per tenant, safe on any input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvroute.policies import ChainKey, FingerprintConfig, Fingerprinter
from kvroute.policies.render import render_request

FP = Fingerprinter()
SYSTEM = "You are a careful assistant. " * 60


def chat(*turns: str, system: str = SYSTEM, **extra):
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs, **extra}


def test_shared_prefix_shares_leading_keys_and_diverges_after():
    a = FP.from_kwargs(chat("question one " * 40))
    b = FP.from_kwargs(chat("question two " * 40))
    shared = 0
    while shared < min(len(a.keys), len(b.keys)) and a.keys[shared] == b.keys[shared]:
        shared += 1
    assert shared >= len(SYSTEM.encode()) // 256 - 1
    assert a.keys != b.keys
    assert a.keys[:shared] == b.keys[:shared]


def test_model_and_tenant_salt_seed_the_chain():
    base = FP.from_kwargs(chat("q" * 400))
    other_model = FP.from_kwargs({**chat("q" * 400), "model": "other"})
    t1 = FP.from_kwargs(chat("q" * 400), tenant="acme", isolate_tenant=True)
    t2 = FP.from_kwargs(chat("q" * 400), tenant="globex", isolate_tenant=True)
    shared_tenant = FP.from_kwargs(chat("q" * 400), tenant="acme", isolate_tenant=False)
    assert not set(base.keys) & set(other_model.keys)
    assert not set(t1.keys) & set(t2.keys)
    assert not set(t1.keys) & set(base.keys)
    assert shared_tenant.keys == base.keys


def test_cache_salt_enters_the_key():
    assert not set(FP.from_kwargs(chat("x" * 900)).keys) & set(
        FP.from_kwargs(chat("x" * 900, cache_salt="s1")).keys
    )


def test_keys_equal_across_processes():
    kwargs = chat("hello " * 300, "answer " * 100, "follow up " * 50)
    here = FP.from_kwargs(kwargs).keys
    code = (
        "import json,sys; from kvroute.policies import Fingerprinter;"
        "print(json.dumps(Fingerprinter().from_kwargs(json.loads(sys.stdin.read())).keys))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(kwargs), capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin"})
    assert json.loads(out.stdout) == list(here)


def test_tools_render_before_messages_and_order_matters():
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
             for i in range(30)]
    a = FP.from_kwargs({**chat("q"), "tools": tools})
    b = FP.from_kwargs({**chat("q"), "tools": list(reversed(tools))})
    assert a.keys[0] != b.keys[0]
    assert a.prompt_tokens > FP.from_kwargs(chat("q")).prompt_tokens


def test_multipart_media_tool_calls_and_results():
    kwargs = {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "https://x/img.png"}},
                                     {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "result"},
    ]}
    req = FP.from_kwargs(kwargs)
    assert req.kind == "chat" and req.keys and not req.notes
    other = FP.from_kwargs({**kwargs, "messages": [*kwargs["messages"][:1], {
        "role": "user", "content": [{"type": "text", "text": "look"},
                                    {"type": "image_url", "image_url": {"url": "https://x/other.png"}}]}]})
    assert other.keys[-1] != req.keys[-1]


def test_completion_prompt_and_token_ids_and_responses_input():
    text = FP.from_kwargs({"model": "m", "prompt": "abc " * 500})
    assert text.kind == "completion" and text.keys
    ids = FP.from_kwargs({"model": "m", "prompt": list(range(1000))})
    assert ids.kind == "tokens" and ids.key_space == "tokens" and len(ids.keys) == 1000 // 64
    assert ids.prompt_tokens == 1000
    resp = FP.from_kwargs({"model": "m", "instructions": SYSTEM, "input": [
        {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "1", "output": "x"}]})
    assert resp.kind == "responses" and resp.keys


def test_token_ids_path_matches_from_token_ids():
    ids = list(range(5000, 5640))
    a = FP.from_kwargs({"model": "m", "prompt": ids})
    b = FP.from_token_ids(ids, model="m", block_size=64)
    assert list(a.keys) == list(b.keys)


def test_session_key_sources_and_tenant_scope():
    meta = FP.from_kwargs({**chat("q"), "metadata": {"session_id": "s-1"}}).session_key
    header = FP.from_kwargs(chat("q"), headers={"X-Session-Id": "s-1"}).session_key
    user = FP.from_kwargs({**chat("q"), "user": "s-1"}).session_key
    assert meta == header == user is not None
    assert FP.from_kwargs(chat("q")).session_key is None
    assert FP.from_kwargs({**chat("q"), "user": "s-1"}, tenant="t").session_key != user
    assert "s-1" not in (meta or "")  # only a hash is kept


def test_block_size_is_configurable_and_partial_block_is_not_hashed():
    fp = Fingerprinter(FingerprintConfig(block_bytes=64))
    req = fp.from_kwargs({"model": "m", "prompt": "x" * 200})
    assert len(req.keys) == 200 // 64
    assert req.block_tokens == 16


def test_huge_prompt_is_capped_and_cheap():
    req = FP.from_kwargs({"model": "m", "messages": [{"role": "user", "content": "y" * 4_400_000}]})
    assert req.prompt_tokens >= 1_100_000
    assert len(req.keys) == 131_072 * 4 // 256


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text() | st.binary(max_size=50),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
))
def test_arbitrary_messages_never_raise(messages):
    req = FP.from_kwargs({"model": "m", "messages": messages, "tools": messages})
    assert req.request_id and isinstance(list(req.keys), list)


@given(st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), min_size=1))
def test_lone_surrogates_and_any_text(text):
    req = FP.from_kwargs({"model": "m", "messages": [{"role": "user", "content": text * 50}]})
    assert req.kind == "chat"


def test_deeply_nested_tool_json_and_bad_shapes():
    deep: dict = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    for kwargs in ({"model": "m", "tools": [deep], "messages": []},
                   {"model": "m", "messages": None},
                   {"model": "m", "messages": "not a list"},
                   {"model": "m", "messages": [{"role": 5, "content": {"weird": object()}}]},
                   {"model": None},
                   {}):
        req = FP.from_kwargs(kwargs)
        assert req.request_id
    assert FP.from_kwargs("garbage").kind in {"invalid", "empty"}  # type: ignore[arg-type]


# --- keyed chains -----------------------------------------------------------------------------------------
SECRET = bytes(range(32))
KEYED = Fingerprinter(FingerprintConfig(chain=ChainKey(SECRET)))
TEMPLATE = "Bank assistant. Verify the customer before answering. " * 8


def pin_request(pin: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": TEMPLATE},
                                       {"role": "user", "content": f"My PIN is {pin}. " + "Balance please. " * 30}]}


def test_secret_keys_every_chain_and_agrees_across_processes():
    kwargs = chat("hello " * 300)
    public, keyed = FP.from_kwargs(kwargs).keys, KEYED.from_kwargs(kwargs).keys
    other = Fingerprinter(FingerprintConfig(chain=ChainKey(b"another secret, 32 bytes long!!!"))).from_kwargs(kwargs)
    assert len(public) == len(keyed) > 4
    assert not set(public) & set(keyed) and not set(keyed) & set(other.keys)
    code = ("import json,sys; from kvroute.policies import ChainKey, FingerprintConfig, Fingerprinter;"
            "fp = Fingerprinter(FingerprintConfig(chain=ChainKey(bytes(range(32)))));"
            "print(json.dumps(fp.from_kwargs(json.loads(sys.stdin.read())).keys))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(kwargs), capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "99", "PATH": "/usr/bin"})
    assert json.loads(out.stdout) == list(keyed)
    alice = {**kwargs, "user": "alice"}
    assert KEYED.from_kwargs(alice).session_key != FP.from_kwargs(alice).session_key


def test_short_or_missing_secret_is_refused_and_empty_means_unkeyed():
    import pytest

    with pytest.raises(ValueError):
        ChainKey(b"short")
    assert not ChainKey().keyed and ChainKey().step == 0 and ChainKey(SECRET).step != 0


def _confirm_pin(leaked_keys: list[int]) -> list[str]:
    """The attack: the template is known, the keys leaked (Redis, a forwarded cache key); try every PIN both
    by recomputing the public chain and by extending the chain from the leaked key before the PIN's block."""
    data = b"".join(render_request(pin_request("0000")).segments)
    j = data.index(b"My PIN is ") // 256
    assert (data.index(b"My PIN is ") + 20) // 256 == j  # the PIN sits inside block j
    leaked = set(leaked_keys)
    hits = []
    for n in range(10_000):
        pin = f"{n:04d}"
        guess = pin_request(pin)
        block = b"".join(render_request(guess).segments)[j * 256:(j + 1) * 256]
        if xxhash.xxh3_64_intdigest(block, leaked_keys[j - 1]) in leaked or FP.from_kwargs(guess).keys[j] in leaked:
            hits.append(pin)
    return hits


def test_a_guessed_pin_is_confirmed_from_unkeyed_keys_but_not_from_keyed_ones():
    assert _confirm_pin(list(FP.from_kwargs(pin_request("4711")).keys)) == ["4711"]  # the attack works unkeyed
    victim = list(KEYED.from_kwargs(pin_request("4711")).keys)
    assert _confirm_pin(victim) == []
    # whoever holds the secret (every kvroute worker) still matches the prefix exactly
    assert KEYED.from_kwargs(pin_request("4711")).keys == victim


def _conversation(rng, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "sys " * rng.randrange(10, 400)}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": " ".join(str(rng.random()) for _ in range(rng.randrange(1, 120)))})
    return msgs


def test_remembered_prefix_chains_equal_a_fresh_chain_for_turns_siblings_tenants_and_secrets():
    import random

    from kvroute.policies.fingerprint import chain_keys
    rng = random.Random(5)
    for secret in (b"", b"k" * 32):
        cfg = FingerprintConfig(chain=ChainKey(secret))
        cached, plain = Fingerprinter(cfg), Fingerprinter(FingerprintConfig(chain=ChainKey(secret),
                                                                            prefix_chain_keys=0))
        assert plain.prefix_chains is None
        for _ in range(30):
            msgs = _conversation(rng, rng.randrange(1, 12))
            tenant = rng.choice([None, "acme", "globex"])
            for turn in range(1, len(msgs) + 1):  # the conversation growing turn by turn, then siblings
                for kw in ({"model": "m", "messages": msgs[:turn]},
                           {"model": "m", "messages": [*msgs[:turn], {"role": "user", "content": "sib"}]}):
                    a = cached.from_kwargs(kw, tenant=tenant, isolate_tenant=True)
                    b = plain.from_kwargs(kw, tenant=tenant, isolate_tenant=True)
                    assert a.keys == b.keys
                    data = b"".join(render_request(kw).segments)
                    assert a.keys == chain_keys(data, 256, cached.seed("m", tenant), 10**6, cached.chain.step)
        assert cached.prefix_chains.hits > cached.prefix_chains.misses


def test_prefix_chains_hold_only_keys_within_their_bound_and_callers_own_their_lists():
    from kvroute.policies.fingerprint import PrefixChains
    chains = PrefixChains(max_keys=300)
    fp = Fingerprinter()
    fp.prefix_chains = chains
    for i in range(50):
        req = fp.from_kwargs(chat(f"question {i} " * 200, "answer " * 100, "more " * 50))
        req.keys.append(-1)  # a caller mutating its list must not change what is remembered
        assert chains.held_keys <= 300
    for (seed, blocks, digest), keys in chains._entries.items():
        assert all(isinstance(k, int) and k >= 0 for k in keys) and len(keys) == blocks
        assert isinstance(seed, int) and isinstance(digest, int)
    again = fp.from_kwargs(chat("question 49 " * 200, "answer " * 100, "more " * 50))
    assert again.keys == Fingerprinter(FingerprintConfig(prefix_chain_keys=0)).from_kwargs(
        chat("question 49 " * 200, "answer " * 100, "more " * 50)).keys


def test_a_role_marker_inside_binary_content_is_only_a_probe():
    kw = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": b"x" * 700 + b"\xfe\x00" * 300 + b"y" * 600}]}
    assert b"\xfe\x00" in b"".join(render_request(kw).segments)
    plain = Fingerprinter(FingerprintConfig(prefix_chain_keys=0))
    assert FP.from_kwargs(kw).keys == plain.from_kwargs(kw).keys == FP.from_kwargs(kw).keys


@pytest.mark.parametrize("nblocks", [0, 1, 7, 8, 9, 15, 16, 17, 40])
@pytest.mark.parametrize("step", [0, 0x9E3779B97F4A7C15])
def test_chain_keys_eight_blocks_at_a_time_equal_one_link_per_block(nblocks: int, step: int) -> None:
    import os

    from kvroute.policies.fingerprint import chain_keys

    data = os.urandom(nblocks * 32 + 5)  # a trailing partial block is never hashed
    want, h = [], 12345
    for i in range(nblocks):
        h = xxhash.xxh3_64_intdigest(data[i * 32 : (i + 1) * 32], h ^ step)
        want.append(h)
    assert chain_keys(data, 32, 12345, 1 << 20, step) == want
    assert chain_keys(data, 32, 12345, max(0, nblocks - 3), step) == want[: max(0, nblocks - 3)]
