"""Tokenizing like the engine: a local HF ``tokenizer.json`` plus the model's chat template, or ``/tokenize``.

``LocalTokenizer.encode(kwargs)`` renders chat messages with the template from ``tokenizer_config.json``
(sandboxed jinja2) and tokenizes the result the way vLLM does (no added special tokens for chat; the
tokenizer's own for plain prompts). Per message boundary it caches the token ids of the rendered
conversation, so a warm multi-turn request tokenizes only its new part. Every failure returns None (the
caller falls back to approximate mode) and is counted. Token ids live in memory only, never on disk/logs.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import cachetools
import xxhash

from kvroute.plugin.feeds import precise_metrics as pm
from kvroute.policies.errors import ConfigError

log = logging.getLogger(__name__)
_xxh3 = xxhash.xxh3_64_intdigest


class PromptTokenizer(Protocol):
    """Token ids of an OpenAI-style request, as the engine will see them, or None."""

    def encode(self, kwargs: Mapping[str, Any]) -> Sequence[int] | None: ...


def _special(value: Any) -> str:
    if isinstance(value, Mapping):
        return str(value.get("content") or "")
    return str(value) if isinstance(value, str) else ""


def _message_key(prev: int, message: Any) -> int:
    data = json.dumps(message, sort_keys=True, ensure_ascii=False, default=str, separators=(",", ":"))
    return _xxh3(data.encode("utf-8", "surrogatepass"), prev)


class LocalTokenizer:
    """HF ``tokenizers`` + jinja2 chat template, with a per-message-boundary prefix cache.

    The cache maps a chain hash of the first *n* messages to the rendered text length and its token ids;
    a hit is used only if the rendered text at that boundary is byte-identical (checked by hash), and
    boundaries are verified against a whole-text tokenization on the first cold requests.
    """

    def __init__(self, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None, *,
                 group: str = "", chat_template: str | None = None, cache_tokens: int = 4_000_000,
                 verify_first: int = 8) -> None:
        from tokenizers import Tokenizer

        self.group = group
        path = Path(tokenizer_json)
        if path.is_dir():
            tokenizer_config = tokenizer_config or path / "tokenizer_config.json"
            path = path / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ConfigError("tokenizer", f"cannot load {path}: {exc}") from None
        config: Mapping[str, Any] = {}
        if tokenizer_config is not None and Path(tokenizer_config).exists():
            try:
                config = json.loads(Path(tokenizer_config).read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError("tokenizer_config", f"cannot read {tokenizer_config}: {exc}") from None
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        self._template = self._compile(template) if isinstance(template, str) else None
        self._specials = {"bos_token": _special(config.get("bos_token")),
                          "eos_token": _special(config.get("eos_token"))}
        self._cache: cachetools.LRUCache = cachetools.LRUCache(maxsize=cache_tokens, getsizeof=lambda v: len(v[2]) + 1)
        self._verify_left = verify_first
        self._splittable = True
        self.stats = {"warm": 0, "cold": 0, "error": 0, "cached_tokens": 0, "new_tokens": 0}
        self._gen_suffix: str | None = self._generation_suffix()
        self._suffix_ids: list[int] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kw: Any) -> LocalTokenizer:
        return cls(Path(model_dir) / "tokenizer.json", Path(model_dir) / "tokenizer_config.json", **kw)

    @staticmethod
    def _compile(template: str) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(template)
        except Exception as exc:
            raise ConfigError("chat_template", f"does not compile: {exc}") from None

    def _render(self, messages: Sequence[Any], add_generation_prompt: bool, extra: Mapping[str, Any]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._specials, **extra)

    def _generation_suffix(self) -> str | None:
        """What ``add_generation_prompt`` appends, if it only appends (else boundaries are not cached)."""
        if self._template is None:
            return None
        try:
            probe = [{"role": "user", "content": "kvroute-probe"}]
            with_gen = self._render(probe, True, {})
            without = self._render(probe, False, {})
        except Exception:
            return None
        return with_gen[len(without):] if with_gen.startswith(without) else None

    def _ids(self, text: str, special: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special).ids

    # --- public ---------------------------------------------------------------------------------
    def encode(self, kwargs: Mapping[str, Any]) -> Sequence[int] | None:
        """Token ids for ``messages`` (chat template) or ``prompt`` (text or ids); None on any failure."""
        try:
            messages = kwargs.get("messages")
            if messages is not None:
                return self._encode_chat(messages, kwargs)
            prompt = kwargs.get("prompt")
            if isinstance(prompt, str):
                ids = self._tok.encode(prompt).ids
                self._count("cold", 0, len(ids))
                return ids
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                return self._tok.encode(prompt[0]).ids
            raise ValueError("no messages or prompt")
        except Exception as exc:
            self._count("error", 0, 0)
            log.debug("tokenizer fallback: %s", type(exc).__name__)
            return None

    def _count(self, outcome: str, cached: int, new: int) -> None:
        self.stats[outcome] += 1
        self.stats["cached_tokens"] += cached
        self.stats["new_tokens"] += new
        pm.TOKENIZER_REQUESTS.labels(self.group, outcome).inc()
        if cached:
            pm.TOKENIZER_CACHE_TOKENS.labels(self.group, "hit").inc(cached)
        if new:
            pm.TOKENIZER_CACHE_TOKENS.labels(self.group, "miss").inc(new)

    def hit_rate(self) -> float | None:
        total = self.stats["cached_tokens"] + self.stats["new_tokens"]
        return self.stats["cached_tokens"] / total if total else None

    def _encode_chat(self, messages: Any, kwargs: Mapping[str, Any]) -> Sequence[int]:
        if self._template is None:
            raise ValueError("no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is not a non-empty list")
        extra = {k: kwargs[k] for k in ("tools", "documents") if kwargs.get(k) is not None}
        extra.update(kwargs.get("chat_template_kwargs") or {})
        text = self._render(messages, True, extra)
        suffix = self._gen_suffix
        if suffix is None or extra or not self._splittable or not text.endswith(suffix):
            ids = self._ids(text)
            self._count("cold", 0, len(ids))
            return ids
        body_len = len(text) - len(suffix)
        # Chain keys of message prefixes; the deepest one cached with identical rendered text wins.
        chain: list[int] = []
        h = 0
        for m in messages:
            h = _message_key(h, m)
            chain.append(h)
        base_len, base_ids = 0, None
        for depth in range(len(chain) - 1, -1, -1):
            entry = self._cache.get(chain[depth])
            if entry is None:
                continue
            length, text_hash, ids = entry
            if length <= body_len and _xxh3(text[:length].encode("utf-8", "surrogatepass")) == text_hash:
                base_len, base_ids = length, ids
                break
        body = text[base_len:body_len]
        new_body = self._ids(body) if body else []
        body_ids = array("I", base_ids) if base_ids is not None else array("I")
        body_ids.extend(new_body)
        if self._suffix_ids is None:
            self._suffix_ids = self._ids(suffix) if suffix else []
        tail = self._suffix_ids
        if self._verify_left > 0:
            self._verify_left -= 1
            whole = self._ids(text)
            if list(body_ids) + tail != whole:
                self._splittable = False  # this tokenizer merges across boundaries: no prefix cache
                log.info("tokenizer for %s does not split at message boundaries; prefix cache off", self.group)
                self._count("cold", 0, len(whole))
                return whole
        self._cache[chain[-1]] = (body_len, _xxh3(text[:body_len].encode("utf-8", "surrogatepass")), body_ids)
        result = list(body_ids)
        result.extend(tail)
        if base_ids is not None:
            self._count("warm", len(base_ids), len(new_body) + len(tail))
        else:
            self._count("cold", 0, len(result))
        return result


class EngineTokenizer:
    """The engine's own ``POST /tokenize`` (vLLM, SGLang): exact by construction, one HTTP call per request."""

    def __init__(self, base_url: str, model: str, *, group: str = "", timeout_s: float = 2.0,
                 client: Any = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.group = group
        self._client = client or httpx.Client(timeout=timeout_s)
        self._aclient: Any = None
        self._timeout = timeout_s
        self.stats = {"warm": 0, "cold": 0, "error": 0, "cached_tokens": 0, "new_tokens": 0}

    def _body(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if kwargs.get("messages") is not None:
            return {"model": self.model, "messages": kwargs["messages"], "add_generation_prompt": True,
                    "add_special_tokens": False}
        if kwargs.get("prompt") is not None:
            return {"model": self.model, "prompt": kwargs["prompt"]}
        raise ValueError("no messages or prompt")

    def _parse(self, data: Any) -> list[int]:
        tokens = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError("malformed /tokenize answer")
        self.stats["cold"] += 1
        self.stats["new_tokens"] += len(tokens)
        pm.TOKENIZER_REQUESTS.labels(self.group, "engine").inc()
        return tokens

    def encode(self, kwargs: Mapping[str, Any]) -> Sequence[int] | None:
        try:
            resp = self._client.post(f"{self.base_url}/tokenize", json=self._body(kwargs))
            resp.raise_for_status()
            return self._parse(resp.json())
        except Exception:
            return self._failed()

    async def aencode(self, kwargs: Mapping[str, Any]) -> Sequence[int] | None:
        import httpx

        try:
            if self._aclient is None:
                self._aclient = httpx.AsyncClient(timeout=self._timeout)
            resp = await self._aclient.post(f"{self.base_url}/tokenize", json=self._body(kwargs))
            resp.raise_for_status()
            return self._parse(resp.json())
        except Exception:
            return self._failed()

    def _failed(self) -> None:
        """Count a failed /tokenize call; the caller falls back to approximate routing."""
        self.stats["error"] += 1
        pm.TOKENIZER_REQUESTS.labels(self.group, "error").inc()

    def close(self) -> None:
        self._client.close()
