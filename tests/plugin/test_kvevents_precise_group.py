"""PreciseGroup: token-aligned request keys that match event-fed index keys; fallbacks; config; metrics."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvroute.plugin.feeds import precise_metrics as pm
from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
from kvroute.plugin.feeds.precise import PreciseGroup, group_from_config
from kvroute.plugin.feeds.tokenizing import LocalTokenizer
from kvroute.policies import Router
from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import chain_seed, token_keys
from kvroute.policies.precise_index import PreciseIndex

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kvevents"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cache holds the prefix of every request"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return d


def chat(n_words=200):
    return {"model": "tiny", "messages": [{"role": "system", "content": "the cache holds the prefix " * n_words},
                                          {"role": "user", "content": "every request"}]}


def test_request_keys_match_what_events_store(model_dir):
    index = PreciseIndex()
    tok = LocalTokenizer.from_dir(model_dir)
    group = PreciseGroup("tiny", index, sources=[EventSource("inproc://x", backend="A", topic="kv")],
                         tokenizer=tok, block_size=16)
    ids = tok.encode(chat())
    full = len(ids) // 16 * 16
    # What vLLM would publish after prefilling this prompt: its own hashes, our keys come from token ids.
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": list(range(900, 900 + full // 16)),
                                             "parent_block_hash": None, "token_ids": ids[:full], "block_size": 16,
                                             "medium": "GPU"}]])
    assert group.feed is not None
    group.feed.ingest(group.feed._stream(0, b"kv"), 0, payload, live=True)
    request = group.fingerprint(chat(), request_id="r1", tenant="t")
    assert request is not None and request.key_space == "tokens" and request.block_tokens == 16
    assert request.prompt_tokens == len(ids) and request.request_id == "r1" and request.tenant == "t"
    router = Router(index=index)
    decision = router.pick(request, ["A", "B"])
    assert decision.backend == "A" and decision.matched_blocks == full // 16
    assert group.decisions == {"precise": 1, "fallback": 0}


def test_cache_salt_and_lora_change_the_key_space(model_dir):
    group = PreciseGroup("tiny", PreciseIndex(), tokenizer=LocalTokenizer.from_dir(model_dir), block_size=16)
    plain = group.fingerprint(chat())
    salted = group.fingerprint({**chat(), "cache_salt": "s1"})
    lora = group.fingerprint(chat(), lora_name="my-lora")
    ids = group.tokenizer.encode(chat())
    assert plain.keys == token_keys(ids, 16, chain_seed("tiny"), 10**6)
    assert salted.keys == token_keys(ids, 16, chain_seed("tiny", "s1"), 10**6)
    assert lora.keys == token_keys(ids, 16, chain_seed("my-lora"), 10**6)


def test_fallbacks_are_counted(model_dir):
    before = pm.REGISTRY.get_sample_value("kvroute_precise_decisions_total",
                                          {"group": "fb", "mode": "fallback", "reason": "tokenizer_error"}) or 0
    group = PreciseGroup("fb", PreciseIndex(), tokenizer=LocalTokenizer.from_dir(model_dir))
    assert group.fingerprint(chat()) is None  # block size not known yet
    group._learn_block_size("A", 16)
    assert group.block_size == 16
    assert group.fingerprint({"messages": "garbage"}) is None
    assert PreciseGroup("fb", PreciseIndex(), block_size=16).fingerprint(chat()) is None  # no tokenizer
    assert group.decisions == {"precise": 0, "fallback": 2}
    after = pm.REGISTRY.get_sample_value("kvroute_precise_decisions_total",
                                         {"group": "fb", "mode": "fallback", "reason": "tokenizer_error"})
    assert after == before + 1


async def test_async_fingerprint_with_a_local_tokenizer(model_dir):
    group = PreciseGroup("tiny", PreciseIndex(), tokenizer=LocalTokenizer.from_dir(model_dir), block_size=16)
    request = await group.afingerprint(chat())
    assert request is not None and request.keys


def test_block_size_is_learned_from_events(model_dir):
    index = PreciseIndex()
    group = PreciseGroup("tiny", index, sources=[EventSource("inproc://y", backend="A", topic="kv")],
                         tokenizer=LocalTokenizer.from_dir(model_dir))
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, list(range(32)), 32]]])
    group.feed.ingest(group.feed._stream(0, b"kv"), 0, payload, live=True)
    assert group.block_size == 32


def test_group_from_config(model_dir):
    index = PreciseIndex()
    group = group_from_config("tiny", {"sources": [{"endpoint": "tcp://127.0.0.1:5557", "backend": "A",
                                                    "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv"}],
                                       "tokenizer": str(model_dir), "block_size": 16,
                                       "metrics": {"A": "http://127.0.0.1:8000/metrics"}}, index)
    assert group.block_size == 16 and group.feed is not None and group.scraper is not None
    assert index.covers("A")
    for bad, key in [({"sources": [{"backend": "A"}]}, "sources[0]"), ({"nope": 1}, "nope"),
                     ({"block_size": 0}, "block_size"), ({"sources": [{"endpoint": "x", "bind": "yes"}]}, "bind"),
                     ({"metrics": ["x"]}, "metrics"), ({"sources": [{"endpoint": "x", "colour": 1}]}, "colour")]:
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
            group_from_config("tiny", bad, PreciseIndex())
    with pytest.raises(ConfigError):
        group_from_config("tiny", "not a mapping", PreciseIndex())  # type: ignore[arg-type]


def test_recorded_vllm_batches_build_an_index_that_request_keys_match():
    path = FIXTURES / "vllm-0.32-cpu-batches.msgpack"
    assert path.exists(), f"recorded fixture {path} absent"
    records = msgspec.msgpack.decode(path.read_bytes())
    topics = sorted({r[0] for r in records})
    index = PreciseIndex()
    feed = KvEventFeed(index, [EventSource("inproc://rec", topic_backends={t: t for t in topics}, model="tiny")])
    streams = {t: feed._stream(0, t.encode()) for t in topics}
    # The first recorded batch (a cache reset, then the first prompt's blocks): its own keys match the prompt.
    topic, seq, payload = records[0]
    feed.ingest(streams[topic], seq, payload, live=True)
    ev = next(e for e in msgspec.msgpack.decode(payload)[1] if e.get("type") == "BlockStored")
    keys = token_keys(ev["token_ids"], ev["block_size"], chain_seed("tiny"), 10**6)
    assert index.match(keys, topics, 0.0) == {topic: len(ev["block_hashes"])}
    for topic, seq, payload in records[1:]:
        feed.ingest(streams[topic], seq, payload, live=True)
    assert index.blocks() > 0
    assert all(feed.stat(t).decode_errors == 0 for t in topics)
    assert sum(feed.stat(t).blocks_removed for t in topics) > 0
