"""What LiteLLM payloads say about an attempt: cached tokens, TTFT; and the health board adapter.

Whom a failure blames is decided in ``kvroute.policies.outcomes`` (``classify``).

Cached tokens come from ``usage.prompt_tokens_details.cached_tokens`` (OpenAI/vLLM/SGLang; LiteLLM maps
Anthropic ``cache_read_input_tokens`` there too), Anthropic's raw ``cache_read_input_tokens`` and llama.cpp's
``timings.cache_n``. Nothing here reads or keeps prompt text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvroute.plugin.adapter.metrics import Metrics
from kvroute.policies.errors import ConfigError
from kvroute.policies.health import BreakerConfig, HealthBoard, Transition
from kvroute.policies.registry import did_you_mean

#: The metadata key of kvroute's ledger request id (``request_ids`` writes it on a request's first hook).
REQUEST_KEY = "kvroute_request"


def request_metadata(kwargs: Mapping[str, Any], create: bool = False) -> dict[str, Any] | None:
    """The request's metadata dict (the same object reaches every hook of the request): the first of
    ``metadata``, ``litellm_metadata`` and ``litellm_params.metadata`` that holds kvroute's request id, else the
    first that exists (LiteLLM may hang a fresh ``metadata`` dict on a late event, e.g. a client disconnect's)."""
    params = kwargs.get("litellm_params")
    found = None
    for meta in (kwargs.get("metadata"), kwargs.get("litellm_metadata"),
                 params.get("metadata") if isinstance(params, Mapping) else None):
        if isinstance(meta, dict):
            if REQUEST_KEY in meta:
                return meta
            found = found if found is not None else meta
    if found is not None:
        return found
    if create and isinstance(kwargs, dict):
        meta = kwargs["metadata"] = {}
        return meta
    return None


def deployment_id(kwargs: Mapping[str, Any]) -> str | None:
    """The ``model_info.id`` of the deployment an attempt went to, wherever this hook's payload keeps it."""
    info = kwargs.get("model_info")
    if isinstance(info, Mapping) and info.get("id"):
        return str(info["id"])
    slo = kwargs.get("standard_logging_object")
    if isinstance(slo, Mapping) and slo.get("model_id"):
        return str(slo["model_id"])
    params = kwargs.get("litellm_params")
    if isinstance(params, Mapping):
        info = params.get("model_info")
        if isinstance(info, Mapping) and info.get("id"):
            return str(info["id"])
    meta = request_metadata(kwargs)
    if meta and isinstance(meta.get("model_info"), Mapping) and meta["model_info"].get("id"):
        return str(meta["model_info"]["id"])
    return None


def prompt_tokens_of(response_obj: Any, slo: Mapping[str, Any]) -> int:
    """Prompt tokens from the response usage, else the standard logging payload (0 when unknown)."""
    usage = getattr(response_obj, "usage", None)
    if usage is None and isinstance(response_obj, Mapping):
        usage = response_obj.get("usage")
    value = getattr(usage, "prompt_tokens", None) if usage is not None and not isinstance(usage, Mapping) \
        else (usage or {}).get("prompt_tokens")
    if value is None:
        value = slo.get("prompt_tokens")
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def completion_tokens_of(response_obj: Any) -> int | None:
    """Completion tokens from the response usage (None when unknown)."""
    usage = getattr(response_obj, "usage", None)
    value = getattr(usage, "completion_tokens", None) if usage is not None else None
    return int(value) if isinstance(value, int) else None


def duration_s(start: Any, end: Any) -> float | None:
    """Seconds between two datetimes (None when either is missing or the order is wrong)."""
    try:
        value = (end - start).total_seconds()
    except Exception:
        return None
    return value if value >= 0 else None


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or getattr(obj, "_hidden_params", None)
        if isinstance(extra, Mapping):
            value = extra.get(name)
    return value


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def ledger_tokens(response: Any) -> tuple[int, int] | None:
    """(prompt, cache-read) tokens of a response as the ledger counts them (``billing.usage``'s buckets, so a
    dashboard's cached share is the report's); None without a readable usage."""
    usage = _get(response, "usage")
    if usage is None:
        return None
    from kvroute.billing.usage import normalize_usage
    try:
        tokens = normalize_usage(usage)
    except Exception:  # a usage that contradicts itself: the ledger dead-letters it, the metric skips it
        return None
    return tokens.prompt_total, tokens.cache_read


def cached_tokens_of(response: Any) -> int | None:
    """Cached prompt tokens the backend reported, or None when it reported nothing."""
    usage = _get(response, "usage")
    details = _get(usage, "prompt_tokens_details")
    found = _int(_get(details, "cached_tokens"))
    if found is not None:
        return found
    found = _int(_get(usage, "cache_read_input_tokens"))
    if found is not None:
        return found
    timings = _get(response, "timings")
    return _int(_get(timings, "cache_n"))


def _epoch(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def ttft_of(kwargs: Mapping[str, Any], slo: Mapping[str, Any], start: Any, end: Any) -> float | None:
    """Seconds to the first token (for non-streaming calls LiteLLM reports the full response time)."""
    first = _epoch(slo.get("completionStartTime")) or _epoch(kwargs.get("completion_start_time"))
    began = _epoch(slo.get("startTime")) or _epoch(start)
    if first is None or began is None:
        return None
    value = first - began
    return value if 0 <= value < 3600 else None


def breaker_config(knobs: Mapping[str, Any], where: str = "kvroute.breaker") -> BreakerConfig:
    """``BreakerConfig`` from config knobs; unknown or bad knobs raise ``ConfigError`` naming them."""
    names = {f.name for f in dataclasses.fields(BreakerConfig)}
    for key in knobs:
        if key not in names:
            raise ConfigError(f"{where}.{key}", "unknown breaker setting" + did_you_mean(str(key), names))
    try:
        return BreakerConfig(**dict(knobs))
    except (TypeError, ValueError) as exc:
        bad = next((k for k in knobs if k in str(exc)), None)
        raise ConfigError(f"{where}.{bad}" if bad else where, str(exc)) from exc


class HealthAdapter:
    """The plugin's view of ``HealthBoard``: peek/admit, record outcomes, and mirror states to metrics."""

    def __init__(self, board: HealthBoard, metrics: Metrics | None = None) -> None:
        self.board = board
        self.metrics = metrics
        if metrics is not None:
            board.add_listener(self._on_transition)

    @classmethod
    def build(cls, metrics: Metrics | None, config: BreakerConfig | None = None,
              redis: Any = None) -> HealthAdapter:
        board = None
        if redis is not None and hasattr(redis, "health_board"):
            try:
                board = redis.health_board(config)
            except Exception:
                board = None
        return cls(board or HealthBoard(config), metrics)

    def _on_transition(self, t: Transition) -> None:
        if self.metrics is not None:
            self.metrics.breaker(t.backend, t.new.value, t.old.value)

    def available(self, backend: str, now: float) -> bool:
        return self.board.available(backend, now)

    def admit(self, backend: str, now: float) -> bool:
        """Take the half-open probe token for the backend the router chose."""
        return self.board.allow(backend, now)

    def record(self, backend: str, outcome: str, now: float, *, retry_after_s: float | None = None,
               ttft_s: float | None = None, started_at: float | None = None) -> str:
        return self.board.record(backend, outcome, now, retry_after_s=retry_after_s, ttft_s=ttft_s,
                                 started_at=started_at).value

    def state(self, backend: str, now: float) -> str:
        return self.board.state(backend, now).value

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        return self.board.snapshot(now)


def chunk_has_output(chunk: Any) -> bool:
    """Whether a stream chunk carries output tokens (text, reasoning or a tool call); one such chunk ≈ one token."""
    choices = getattr(chunk, "choices", None)
    if not choices:
        return False
    first = choices[0]
    delta = getattr(first, "delta", None)
    if delta is None:
        return bool(getattr(first, "text", None))
    return bool(getattr(delta, "content", None) or getattr(delta, "reasoning_content", None)
                or getattr(delta, "tool_calls", None))
