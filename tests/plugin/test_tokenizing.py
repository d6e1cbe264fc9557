"""Tokenizing like the engine: chat template + HF tokenizer, the per-message prefix cache, /tokenize, fallbacks."""

from __future__ import annotations

import json

import pytest
from loopback import QuietHandler, http_stub
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvroute.plugin.feeds.tokenizing import EngineTokenizer, LocalTokenizer
from kvroute.policies.errors import ConfigError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "routing requests to the replica that holds the cache",
          "system user assistant hello world question answer"] * 50


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                                         "chat_template": CHATML}))
    return d


def conversation(turns):
    msgs = [{"role": "system", "content": "routing requests to the replica that holds the cache " * 20}]
    for i in range(turns + 1):  # each turn appends the reply and a new question to the previous one
        msgs.append({"role": "user", "content": f"question {i}: the quick brown fox"})
        if i < turns:
            msgs.append({"role": "assistant", "content": f"answer {i}: the lazy dog"})
    return msgs


def reference(model_dir, messages, template=CHATML):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_matches_a_whole_text_tokenization(model_dir):
    tok = LocalTokenizer.from_dir(model_dir, group="g")
    msgs = conversation(1)
    assert tok.encode({"messages": msgs}) == reference(model_dir, msgs)
    assert tok.stats["cold"] == 1


def test_warm_multi_turn_tokenizes_only_the_new_part(model_dir):
    tok = LocalTokenizer.from_dir(model_dir, group="g")
    for turns in range(6):
        msgs = conversation(turns)
        assert tok.encode({"messages": msgs}) == reference(model_dir, msgs)
    assert tok.stats["warm"] == 5 and tok.stats["cold"] == 1
    assert tok.hit_rate() > 0.6


def test_an_edited_history_is_not_served_from_the_cache(model_dir):
    tok = LocalTokenizer.from_dir(model_dir, group="g")
    msgs = conversation(2)
    tok.encode({"messages": msgs})
    edited = [dict(m) for m in conversation(3)]
    edited[1]["content"] = "question 0: edited"
    assert tok.encode({"messages": edited}) == reference(model_dir, edited)
    assert tok.stats["warm"] == 0 and tok.stats["cached_tokens"] == 0


def test_template_that_rewrites_history_is_caught_by_the_text_check(model_dir):
    template = ("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    tok = LocalTokenizer(model_dir / "tokenizer.json", model_dir / "tokenizer_config.json", chat_template=template)
    for turns in range(3):
        msgs = conversation(turns)
        assert tok.encode({"messages": msgs}) == reference(model_dir, msgs, template)
    assert tok.stats["warm"] == 0


def test_tokenizer_that_merges_across_boundaries_turns_the_cache_off(model_dir):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}the{% endif %}"
    tok = LocalTokenizer(model_dir / "tokenizer.json", chat_template=template)
    msgs = [{"role": "user", "content": "the quick bro"}, {"role": "user", "content": "wn fox jumps over"}]
    for i in range(1, 3):
        assert tok.encode({"messages": msgs[: i + 0]}) == reference(model_dir, msgs[:i], template)
    assert not tok._splittable
    assert tok.encode({"messages": msgs}) == reference(model_dir, msgs, template)


def test_prompts_and_failures(model_dir):
    tok = LocalTokenizer.from_dir(model_dir, group="g")
    assert tok.encode({"prompt": "hello world"}) == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        "hello world").ids
    assert tok.encode({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tok.encode({"input": "x"}) is None
    assert tok.encode({"messages": []}) is None
    assert tok.encode({"messages": "not a list"}) is None
    failing = LocalTokenizer(model_dir / "tokenizer.json", chat_template="{{ raise_exception('no system role') }}")
    assert failing.encode({"messages": conversation(0)}) is None
    no_template = LocalTokenizer(model_dir / "tokenizer.json")
    assert no_template.encode({"messages": conversation(0)}) is None
    assert tok.stats["error"] == 3 and failing.stats["error"] == 1


def test_bad_tokenizer_files_raise_config_errors(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="tokenizer"):
        LocalTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer_config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config"):
        LocalTokenizer(model_dir / "tokenizer.json", bad)
    with pytest.raises(ConfigError, match="chat_template"):
        LocalTokenizer(model_dir / "tokenizer.json", chat_template="{% for %}")


class _Tokenize(QuietHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("prompt") == "malformed":
            out = {"tokens": "nope"}
        else:
            n = len(body.get("messages") or []) * 10 + len(str(body.get("prompt") or ""))
            out = {"tokens": list(range(n)), "count": n}
        self.reply(200, json.dumps(out).encode(), "application/json")


@pytest.fixture
def tokenize_server():
    with http_stub(_Tokenize) as url:
        yield url + "/v1"


async def test_engine_tokenize_endpoint(tokenize_server):
    tok = EngineTokenizer(tokenize_server, "m", group="g")
    try:
        assert tok.encode({"messages": [{"role": "user", "content": "hi"}]}) == list(range(10))
        assert await tok.aencode({"prompt": "abcd"}) == [0, 1, 2, 3]
        assert tok.encode({"prompt": "malformed"}) is None
        assert tok.encode({}) is None
        assert tok.stats["error"] == 2
    finally:
        tok.close()
    dead = EngineTokenizer("http://127.0.0.1:9", "m", timeout_s=0.5)
    assert dead.encode({"prompt": "x"}) is None
    assert await dead.aencode({"prompt": "x"}) is None
