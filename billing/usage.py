"""Provider usage objects normalised once, at the boundary, into disjoint token buckets.

Buckets: uncached input, cache read, cache write (5 min / 1 h), output, reasoning. ``reasoning`` is the part
of ``output`` spent on reasoning (recorded separately, never added twice). The providers' own rules:
OpenAI-like shapes (OpenAI, Gemini, DeepSeek, OpenRouter, vLLM, llama.cpp, LiteLLM's ``Usage``) report cached
tokens as a subset of prompt tokens; Anthropic's native ``input_tokens`` excludes cache reads and writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kvroute.billing.money import to_decimal
from kvroute.policies.errors import InputError

BUCKETS = ("input_uncached", "cache_read", "cache_write_5m", "cache_write_1h", "output", "reasoning")
#: Largest token count of one bucket of one attempt (far above any context window; keeps amounts in range).
MAX_TOKENS = 10**12


@dataclass(frozen=True, slots=True)
class TokenBuckets:
    """Disjoint token counts of one attempt; ``reasoning`` is a subset of ``output``."""

    input_uncached: int = 0
    cache_read: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0
    output: int = 0
    reasoning: int = 0

    def __post_init__(self) -> None:
        for name in BUCKETS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"usage.{name}", f"must be a non-negative integer, got {value!r}")
            if value > MAX_TOKENS:
                raise InputError(f"usage.{name}", f"{value} tokens exceed the limit of {MAX_TOKENS} per attempt")
        if self.reasoning > self.output:
            raise InputError("usage.reasoning", f"reasoning tokens ({self.reasoning}) exceed output ({self.output})")

    @property
    def prompt_total(self) -> int:
        """All prompt tokens: uncached + cache read + cache writes."""
        return self.input_uncached + self.cache_read + self.cache_write_5m + self.cache_write_1h

    @property
    def cache_write(self) -> int:
        return self.cache_write_5m + self.cache_write_1h

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in BUCKETS}  # the fields, in order (``asdict`` deep-copies)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "usage") -> TokenBuckets:
        """Build from a mapping of bucket names; unknown keys are an error naming the field."""
        unknown = set(data) - set(BUCKETS)
        if unknown:
            raise InputError(f"{where}.{sorted(unknown)[0]}", f"unknown token bucket (known: {', '.join(BUCKETS)})")
        return cls(**{k: data[k] for k in BUCKETS if data.get(k) is not None})


class PlainUsage(dict):
    """A usage ``as_mapping`` made plain (nested details are dicts, leaves scalars): only its type says so, so
    ``normalize_plain`` and the journal read it without converting it again."""

    __slots__ = ()


def as_mapping(obj: Any) -> PlainUsage:
    """A usage object (dict, pydantic model, plain object) as a plain dict, recursively for nested details."""
    if obj is None:
        return PlainUsage()
    if isinstance(obj, Mapping):
        return PlainUsage({k: _plain(v) for k, v in obj.items()})
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        try:
            dumped = dump()
        except Exception:  # a half-built pydantic object: fall back to its attributes
            dumped = None
        if isinstance(dumped, Mapping):
            extra = {k: v for k, v in vars(obj).items() if not k.startswith("_")} if hasattr(obj, "__dict__") else {}
            return PlainUsage({k: _plain(v) for k, v in {**extra, **dumped}.items()})
    if hasattr(obj, "__dict__"):
        return PlainUsage({k: _plain(v) for k, v in vars(obj).items() if not k.startswith("_")})
    return PlainUsage()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool, Decimal)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return as_mapping(value)


#: Whether wrong types are errors (``normalize_usage(strict=True)``, as ingest does) or skipped: on the request
#: path a provider's odd usage field must not cost the event its ledger row.
_STRICT: ContextVar[bool] = ContextVar("kvroute_usage_strict", default=False)


def _int(data: Mapping[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` present (not null) as a non-negative integer.

    Integral floats and decimals (``12.0``) count as integers; strings, booleans, fractions and negative numbers
    are an ``InputError`` in strict mode and skipped otherwise.
    """
    for key in keys:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            if value >= 0 or not _STRICT.get():
                return value
        elif isinstance(value, (float, Decimal)) and _whole(value) and (value >= 0 or not _STRICT.get()):
            return int(value)
        if _STRICT.get():
            raise InputError(f"usage.{key}", f"must be a non-negative integer token count, got {value!r}")
    return None


def _whole(value: float | Decimal) -> bool:
    finite = value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)
    return finite and value == int(value)


def reported_cost(usage: Any) -> Decimal | None:
    """The provider's own cost carried by a usage object (OpenRouter ``usage.cost``), exact; ``None`` if absent."""
    data = as_mapping(usage)
    if data.get("cost") is None and isinstance(data.get("usage"), Mapping):
        data = data["usage"]
    value = data.get("cost")
    if value is None:
        return None
    if isinstance(value, Mapping):
        raise InputError("raw_usage.cost", f"must be a decimal amount, got {type(value).__name__}")
    amount = to_decimal(value, "raw_usage.cost")
    if amount < 0:
        raise InputError("raw_usage.cost", f"must not be negative, got {amount}")
    return amount


def _details(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    if isinstance(value, Mapping):
        return value
    if value is not None and _STRICT.get():
        raise InputError(f"usage.{key}", f"must be an object, got {type(value).__name__}")
    return {}


def _split_writes(total: int, details: Mapping[str, Any]) -> tuple[int, int]:
    """Split a cache-write count into (5 min, 1 h) using ``ephemeral_*`` details; otherwise all 5 min."""
    w5 = _int(details, "ephemeral_5m_input_tokens")
    w1 = _int(details, "ephemeral_1h_input_tokens")
    if w5 is None and w1 is None:
        return total, 0
    w5, w1 = w5 or 0, w1 or 0
    if w5 + w1 > total:
        if _STRICT.get():
            raise InputError("usage.cache_creation", f"the 5 min + 1 h split ({w5} + {w1}) exceeds the "
                                                     f"cache-write total ({total})")
        w1 = min(w1, total)  # never bill more writes than the total says
        return total - w1, w1
    w5 += total - w5 - w1  # the split covers less than the total: the rest is 5 min (Anthropic's default)
    return w5, w1


def normalize_usage(usage: Any, provider: str | None = None, strict: bool = False) -> TokenBuckets:
    """Normalise one provider usage object (any shape in the module docstring) into disjoint buckets.

    Raises ``InputError`` when the object is inconsistent (e.g. cached tokens exceed prompt tokens); ``strict``
    also refuses wrong types (a string token count, details that are not objects) and a cache-write split
    larger than its total, which are otherwise skipped or capped.
    """
    return normalize_plain(as_mapping(usage), provider, strict)


def normalize_plain(data: PlainUsage, provider: str | None = None, strict: bool = False) -> TokenBuckets:
    """``normalize_usage`` of a usage ``as_mapping`` already made plain (a nested object there would read as
    absent: callers with any other mapping use ``normalize_usage``)."""
    token = _STRICT.set(strict)
    try:
        return _normalize(data, provider)
    finally:
        _STRICT.reset(token)


def _normalize(data: dict[str, Any], provider: str | None) -> TokenBuckets:
    if "usage" in data and isinstance(data["usage"], Mapping) and not _has_counts(data):
        data = data["usage"]
    for key in ("usage_metadata", "usageMetadata"):
        if isinstance(data.get(key), Mapping):
            return _gemini(data[key])
    if any(k in data for k in ("promptTokenCount", "prompt_token_count", "candidatesTokenCount")):
        return _gemini(data)
    if "prompt_tokens" in data or "prompt_cache_hit_tokens" in data:
        return _openai_like(data)
    if "input_tokens" in data:
        anthropic = (provider or "").lower() in ("anthropic", "bedrock", "vertex_ai_anthropic") or any(
            k in data for k in ("cache_read_input_tokens", "cache_creation_input_tokens", "cache_creation"))
        return _anthropic(data) if anthropic or "input_tokens_details" not in data else _responses(data)
    if "timings" in data:
        return _llamacpp_timings(data, _details(data, "timings"))
    if not data:
        return TokenBuckets()
    raise InputError("usage", f"unrecognised usage shape with keys {sorted(data)[:8]}")


def _has_counts(data: Mapping[str, Any]) -> bool:
    return any(k in data for k in ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens"))


def _openai_like(data: Mapping[str, Any]) -> TokenBuckets:
    ptd = _details(data, "prompt_tokens_details")
    ctd = _details(data, "completion_tokens_details")
    prompt = _int(data, "prompt_tokens")
    hit = _int(data, "prompt_cache_hit_tokens")
    miss = _int(data, "prompt_cache_miss_tokens")
    if prompt is None:
        prompt = (hit or 0) + (miss or 0)
    cache_read = _int(ptd, "cached_tokens")
    if cache_read is None:
        cache_read = hit if hit is not None else _int(data, "cache_read_input_tokens")
    if cache_read is None and isinstance(data.get("timings"), Mapping):  # llama.cpp without prompt details
        return _llamacpp_timings(data, data["timings"])
    cache_read = cache_read or 0
    write = _int(ptd, "cache_write_tokens", "cache_creation_tokens")
    if write is None:
        write = _int(data, "cache_creation_input_tokens") or 0
    split = _details(ptd, "cache_creation_token_details") or _details(data, "cache_creation")
    w5, w1 = _split_writes(write, split)
    uncached = prompt - cache_read - write
    if uncached < 0:
        raise InputError("usage.prompt_tokens",
                         f"cached ({cache_read}) + cache-write ({write}) tokens exceed prompt tokens ({prompt})")
    output = _int(data, "completion_tokens") or 0
    reasoning = _int(ctd, "reasoning_tokens") or _int(data, "reasoning_tokens") or 0
    return TokenBuckets(uncached, cache_read, w5, w1, output, min(reasoning, output))


def _anthropic(data: Mapping[str, Any]) -> TokenBuckets:
    """Anthropic Messages: ``input_tokens`` excludes cache reads and writes, which are additive."""
    split = _details(data, "cache_creation")
    write = _int(data, "cache_creation_input_tokens")
    if write is None:
        write = (_int(split, "ephemeral_5m_input_tokens") or 0) + (_int(split, "ephemeral_1h_input_tokens") or 0)
    w5, w1 = _split_writes(write, split)
    return TokenBuckets(_int(data, "input_tokens") or 0, _int(data, "cache_read_input_tokens") or 0, w5, w1,
                        _int(data, "output_tokens") or 0, 0)


def _responses(data: Mapping[str, Any]) -> TokenBuckets:
    """OpenAI Responses API: ``input_tokens`` includes ``input_tokens_details.cached_tokens``."""
    cached = _int(_details(data, "input_tokens_details"), "cached_tokens") or 0
    prompt = _int(data, "input_tokens") or 0
    if cached > prompt:
        raise InputError("usage.input_tokens", f"cached tokens ({cached}) exceed input tokens ({prompt})")
    output = _int(data, "output_tokens") or 0
    reasoning = _int(_details(data, "output_tokens_details"), "reasoning_tokens") or 0
    return TokenBuckets(prompt - cached, cached, 0, 0, output, min(reasoning, output))


def _gemini(meta: Mapping[str, Any]) -> TokenBuckets:
    """Gemini ``usageMetadata``: cached content is part of the prompt count; thoughts are billed as output."""
    prompt = _int(meta, "promptTokenCount", "prompt_token_count") or 0
    cached = _int(meta, "cachedContentTokenCount", "cached_content_token_count") or 0
    if cached > prompt:
        raise InputError("usage.promptTokenCount", f"cached tokens ({cached}) exceed prompt tokens ({prompt})")
    candidates = _int(meta, "candidatesTokenCount", "candidates_token_count") or 0
    thoughts = _int(meta, "thoughtsTokenCount", "thoughts_token_count") or 0
    return TokenBuckets(prompt - cached, cached, 0, 0, candidates + thoughts, thoughts)


def _llamacpp_timings(data: Mapping[str, Any], timings: Mapping[str, Any]) -> TokenBuckets:
    """llama.cpp server: ``timings.cache_n`` prompt tokens reused from the KV cache, ``prompt_n`` evaluated."""
    cache_n = _int(timings, "cache_n") or 0
    prompt_n = _int(timings, "prompt_n")
    if prompt_n is None:
        prompt_n = max(0, (_int(data, "prompt_tokens") or 0) - cache_n)
    output = _int(data, "completion_tokens")
    if output is None:
        output = _int(timings, "predicted_n") or 0
    return TokenBuckets(prompt_n, cache_n, 0, 0, output, 0)


def usage_from_stream(chunks: Iterable[Any], provider: str | None = None) -> TokenBuckets:
    """Normalise the usage of a streamed response from its chunks or SSE events (dicts or objects).

    OpenAI-like streams carry usage on the last chunk (``stream_options.include_usage``); Anthropic sends input
    counts in ``message_start`` and cumulative output counts in ``message_delta``; Gemini repeats cumulative
    ``usageMetadata``; llama.cpp puts ``timings`` on the final chunk. The last report of each kind wins.
    """
    merged: dict[str, Any] = {}
    last_gemini: Mapping[str, Any] | None = None
    for chunk in chunks:
        data = as_mapping(chunk)
        kind = data.get("type")
        if kind == "message_start" and isinstance(data.get("message"), Mapping):
            merged.update(_details(data["message"], "usage"))
            continue
        if kind == "message_delta":
            merged.update({k: v for k, v in _details(data, "usage").items() if v is not None})
            continue
        meta = data.get("usageMetadata") or data.get("usage_metadata")
        if isinstance(meta, Mapping):
            last_gemini = meta
            continue
        if isinstance(data.get("usage"), Mapping) and data["usage"]:
            merged.update(data["usage"])
        if isinstance(data.get("timings"), Mapping):
            merged["timings"] = data["timings"]
    if last_gemini is not None and not merged:
        return _gemini(last_gemini)
    return normalize_usage(merged, provider)
