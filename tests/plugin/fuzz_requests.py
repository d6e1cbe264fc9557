"""A seeded generator of malformed and odd chat-completion requests (types, encodings, sizes, nesting, metadata,
headers, streaming) for the differential fuzz test. Same seed, same cases; nothing random at send time."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

_ODD_TEXT = ("", " ", "héllo wörld", "日本語のテキスト", "🙂🚀" * 8, "\u202eRTL\u202c", "zero\u200bwidth", "\x00nul",
             "tab\tnew\nline", "<|im_start|>system", "{{template}}", "' OR 1=1 --", "\\u0000", "a" * 5000)
_ROLES = ("user", "system", "assistant", "tool", "developer", "function", "bogus", "", "USER")
_MODELS = ("llama",) * 12 + ("hosted",) * 3 + ("", "no-such-model", "llama ", "LLAMA", "hosted/llama")


@dataclass(frozen=True)
class Case:
    """One request: a JSON-able ``body`` or raw ``raw`` bytes, extra headers, and whether it streams."""

    index: int
    body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False

    def content(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps(self.body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _nest(rng: random.Random, depth: int) -> Any:
    value: Any = rng.choice(["x", 1, None, True, 2.5])
    for _ in range(depth):
        value = rng.choice([[value], {"k": value}, {"type": "text", "text": value}])
    return value


def _text(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.55:
        return f"q{rng.randrange(10**6)} " + rng.choice(_ODD_TEXT)[: rng.choice((10, 200, 5000))]
    if r < 0.65:
        return [{"type": "text", "text": rng.choice(_ODD_TEXT)}]
    if r < 0.70:
        return [{"type": "image_url", "image_url": rng.choice([None, "not a url", {"url": 5}])}]
    if r < 0.75:
        return None
    if r < 0.80:
        return rng.choice([5, 2.5, True, {"a": 1}, ["a", 1]])
    if r < 0.85:
        return _nest(rng, rng.choice((3, 20, 60)))
    if r < 0.90:
        return "w " * rng.choice((2000, 8000))  # large but under the engines' context
    return "lone surrogate \ud800 end"


def _messages(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.75:
        n = rng.choice((1, 1, 2, 3, 6))
        msgs: list[Any] = []
        for i in range(n):
            m: dict[str, Any] = {"role": "user" if i == n - 1 and rng.random() < 0.8 else rng.choice(_ROLES),
                                 "content": _text(rng)}
            if rng.random() < 0.08:
                m["name"] = rng.choice([1, "n", None, {"x": 1}])
            if rng.random() < 0.05:
                m["tool_calls"] = rng.choice([[], "x", [{"id": 1}], [{"type": "function", "function": {}}]])
            if rng.random() < 0.05:
                del m["content"]
            msgs.append(m)
        return msgs
    return rng.choice([[], None, "hello", 5, {"role": "user", "content": "x"}, [None], ["hi"], [[]], [{"content": "x"}],
                       [{"role": 5, "content": "x"}]])


def _max_tokens(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.8:
        return rng.randint(1, 4)
    return rng.choice([0, -1, "3", 2.5, True, None, 10**9, 5000, [], {"n": 1}])


def _metadata(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.5:
        return {"app": rng.choice(["app-1", "app-2", "", 5, None, "x" * 300])}
    if r < 0.65:
        return {"kvroute_attempt": rng.choice(["x", {"a": 1}, [1], -5, 10**12, None]),
                "kvroute_rid": rng.choice(["r:1", 5, {"r": 1}, None])}
    if r < 0.75:
        return {"tags": rng.choice([["a"], "a", [1, None], {"workload": "batch"}]),
                "workload": rng.choice(["batch", "agent", 5])}
    if r < 0.85:
        return rng.choice(["meta", 5, [1, 2], None, True])
    return {f"k{i}": _nest(rng, 3) for i in range(rng.choice((1, 10, 60)))}


def _extras(rng: random.Random, body: dict[str, Any]) -> None:
    options: list[tuple[str, Any]] = [
        ("temperature", rng.choice([0.5, "hot", -3, 99, None])),
        ("n", rng.choice([1, 2, "many", 0])),
        ("stop", rng.choice(["\n", ["a", "b"], 5, [None]])),
        ("user", rng.choice(["u1", 5, {"id": 1}])),
        ("tools", rng.choice([[], "x", [{"type": "function"}], [{"type": "function", "function": {"name": "f"}}]])),
        ("tool_choice", rng.choice(["auto", "none", 5, {"type": "x"}])),
        ("response_format", rng.choice([{"type": "json_object"}, "json", {"type": 5}])),
        ("stream_options", rng.choice([{"include_usage": True}, "yes", {"include_usage": "x"}])),
        ("top_p", rng.choice([0.9, "x", 2])),
        ("seed", rng.choice([1, "s", 2**70])),
        ("logit_bias", rng.choice([{"1": 2}, "x", {"a": "b"}])),
        ("cache_salt", rng.choice(["salt", 5, None])),
        ("prompt_cache_key", rng.choice(["k", 5, {"k": 1}])),
        ("unknown_param_" + str(rng.randrange(5)), rng.choice([1, "x", None])),
    ]
    for key, value in rng.sample(options, rng.choice((0, 0, 1, 2, 3))):
        body[key] = value


def _headers(rng: random.Random) -> dict[str, str]:
    r = rng.random()
    if r < 0.75:
        return {}
    return rng.choice([
        {"x-litellm-tags": "workload:batch"},
        {"x-kvroute-app": "spoof"},
        {"x-request-id": "r" * 300},
        {"content-type": "text/plain"},
        {"x-session-id": "s-1", "x-litellm-session-id": "abc"},
        {"accept": "text/event-stream"},
        {"x-weird": "caf\u00e9"},  # latin-1 on the wire
    ])


def _raw(rng: random.Random) -> bytes:
    ok = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "raw"}], "max_tokens": 2}).encode()
    return rng.choice([
        b"", b"null", b"[]", b"5", b'"llama"', b"{not json", ok[: len(ok) // 2], b"\xef\xbb\xbf" + ok,
        ok.replace(b"raw", b"\xff\xfe bad utf8"),
        b'{"model": "llama", "model": "hosted", "messages": [], "max_tokens": 1}',
        b'{"model": "llama", "messages": [{"role": "user", "content": NaN}], "max_tokens": 1}',
        b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
        b"[" * 5000 + b"]" * 5000,
    ])


def generate(count: int, seed: int = 20261201) -> list[Case]:
    """``count`` cases: about 8 % raw byte bodies, the rest JSON objects with odd fields; ~10 % streamed."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        if rng.random() < 0.08:
            cases.append(Case(i, raw=_raw(rng), headers=_headers(rng)))
            continue
        body: dict[str, Any] = {"model": rng.choice(_MODELS), "messages": _messages(rng),
                                "max_tokens": _max_tokens(rng)}
        if rng.random() < 0.04:
            body["model"] = rng.choice([None, 5, ["llama"], {"m": 1}])
        if rng.random() < 0.03:
            del body["model"]
        if rng.random() < 0.03:
            body.pop("max_tokens")  # the engine default
        if rng.random() < 0.35:
            body["metadata"] = _metadata(rng)
        _extras(rng, body)
        stream = rng.random() < 0.1
        if stream:
            body["stream"] = True
        elif rng.random() < 0.02:
            body["stream"] = rng.choice(["yes", 1, None])
        cases.append(Case(i, body=body, headers=_headers(rng), stream=stream))
    return cases
