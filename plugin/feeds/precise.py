"""Precise mode for one model group: event feed(s) + tokenizer + engine metrics around a ``PreciseIndex``.

Wiring (plugin side)::

    index = PreciseIndex()                      # shared by all groups: Router(index=index)
    group = PreciseGroup("llama", index, sources=[EventSource("tcp://10.0.0.5:5557", backend="a")],
                         tokenizer=LocalTokenizer.from_dir("/models/llama"), metrics={"a": "http://a/metrics"},
                         router=router)
    group.start()
    request = group.fingerprint(kwargs, request_id=rid) or router.fingerprint(kwargs, ...)  # None → approximate

Request keys are ``token_keys(ids, engine_block_size, chain_seed(model or LoRA, salt, index.chain), step)``:
exactly the keys the index computes from ``BlockStored`` token ids (whose block 0 carries the ``cache_salt``
the plugin sent), so matches are engine-confirmed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.plugin.feeds import precise_metrics as pm
from kvroute.plugin.feeds.engine_metrics import EngineMetricsScraper
from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
from kvroute.plugin.feeds.tokenizing import PromptTokenizer
from kvroute.policies.fingerprint import chain_seed, new_request_id, session_key, token_keys
from kvroute.policies.precise_index import PreciseIndex
from kvroute.policies.request import RoutingRequest
from kvroute.policies.tiers import TierCredit

log = logging.getLogger(__name__)


class PreciseGroup:
    """Everything precise routing needs for one model group; ``fingerprint`` returns None to fall back."""

    def __init__(self, model: str, index: PreciseIndex, *, sources: Sequence[EventSource] = (),
                 tokenizer: PromptTokenizer | None = None, block_size: int | None = None,
                 metrics: Mapping[str, str] | None = None, router: Any = None, metrics_interval_s: float = 1.0,
                 max_prefix_tokens: int = 131_072) -> None:
        self.model = model
        self.index = index
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_prefix_tokens = max_prefix_tokens
        self.router = router
        srcs = [s if s.model else _with_model(s, model) for s in sources]
        self.feed = KvEventFeed(index, srcs, on_block_size=self._learn_block_size) if srcs else None
        self.scraper: EngineMetricsScraper | None = None
        if metrics:
            self.scraper = EngineMetricsScraper(
                metrics, self._observe, capacity_sink=index.set_capacity,
                block_size_sink=self._learn_block_size, interval_s=metrics_interval_s,
                clock=router.clock if router is not None else time.monotonic)
        self._seeds: dict[tuple[str, str | None], int] = {}
        self.decisions = {"precise": 0, "fallback": 0}

    def _observe(self, backend: str, signal: Any) -> None:
        if self.router is not None:
            self.router.observe(backend, signal)

    def _learn_block_size(self, backend: str, block_size: int) -> None:
        if self.block_size is None and block_size > 0:
            self.block_size = block_size
            log.info("precise group %s: engine block size %d", self.model, block_size)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> PreciseGroup:
        if self.feed is not None:
            self.feed.start()
        if self.scraper is not None:
            self.scraper.start()
        return self

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
        if self.scraper is not None:
            self.scraper.stop()
        close = getattr(self.tokenizer, "close", None)
        if callable(close):
            close()

    # --- the request path -----------------------------------------------------------------------
    def _fallback(self, reason: str) -> None:
        self.decisions["fallback"] += 1
        pm.PRECISE_DECISIONS.labels(self.model, "fallback", reason).inc()
        return None

    def fingerprint(self, kwargs: Mapping[str, Any], *, model: str | None = None, lora_name: str | None = None,
                    **fields: Any) -> RoutingRequest | None:
        """Token-aligned request keys in the engine's block size, or None (caller uses approximate mode)."""
        try:
            if self.tokenizer is None:
                return self._fallback("no_tokenizer")
            if not self.block_size:
                return self._fallback("no_block_size")
            ids = self.tokenizer.encode(kwargs)
            if ids is None:
                return self._fallback("tokenizer_error")
            return self._request(ids, kwargs, model, lora_name, fields)
        except Exception as exc:
            log.debug("precise fingerprint failed: %s", type(exc).__name__)
            return self._fallback("error")

    async def afingerprint(self, kwargs: Mapping[str, Any], *, model: str | None = None,
                           lora_name: str | None = None, **fields: Any) -> RoutingRequest | None:
        """Like ``fingerprint``; awaits the engine's ``/tokenize`` when that is the tokenizer."""
        aencode = getattr(self.tokenizer, "aencode", None)
        if aencode is None:
            return self.fingerprint(kwargs, model=model, lora_name=lora_name, **fields)
        try:
            if not self.block_size:
                return self._fallback("no_block_size")
            ids = await aencode(kwargs)
            if ids is None:
                return self._fallback("tokenizer_error")
            return self._request(ids, kwargs, model, lora_name, fields)
        except Exception:
            return self._fallback("error")

    def _request(self, ids: Sequence[int], kwargs: Mapping[str, Any], model: str | None, lora_name: str | None,
                 fields: dict[str, Any]) -> RoutingRequest:
        bs = int(self.block_size or 0)
        # the plugin decides the salt (tenant isolation, a trusted client's salt); bare callers pass cache_salt
        salt = fields.get("salt") if "salt" in fields else kwargs.get("cache_salt")
        salt = str(salt) if salt else None
        chain = self.index.chain
        seed_key = (lora_name or self.model, salt)
        seed = self._seeds.get(seed_key)
        if seed is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            seed = self._seeds[seed_key] = chain_seed(*seed_key, chain)
        keys = token_keys(ids, bs, seed, max(1, self.max_prefix_tokens // bs), chain.step)
        tenant = fields.get("tenant")
        self.decisions["precise"] += 1
        pm.PRECISE_DECISIONS.labels(self.model, "precise", "ok").inc()
        return RoutingRequest(
            model=str(model or kwargs.get("model") or self.model),
            keys=keys,
            block_tokens=bs,
            prompt_tokens=len(ids),
            session_key=session_key(kwargs, fields.get("headers"), tenant, chain),
            tenant=tenant,
            app=fields.get("app"),
            tags=dict(fields.get("tags") or {}),
            request_id=fields.get("request_id") or new_request_id(),
            kind="chat" if kwargs.get("messages") is not None else "completion",
            notes=("precise",),
            key_space="tokens",
        )


def _with_model(source: EventSource, model: str) -> EventSource:
    from dataclasses import replace

    return replace(source, model=model)


_SOURCE_KEYS = {"endpoint", "backend", "topic", "replay_endpoint", "bind", "model", "topic_backends"}
_GROUP_KEYS = {"sources", "tokenizer", "tokenizer_config", "tokenize_url", "block_size", "metrics",
               "metrics_interval_s", "max_prefix_tokens", "enabled", "tier_credit"}


def group_from_config(group: str, config: Mapping[str, Any], index: PreciseIndex, *, router: Any = None,
                      where: str | None = None) -> PreciseGroup:
    """Build a ``PreciseGroup`` from a config mapping (the ``precise:`` block of a model group).

    Keys: ``sources`` (list of {endpoint, backend, topic, replay_endpoint, bind, topic_backends}),
    ``tokenizer`` (model dir or tokenizer.json) or ``tokenize_url`` (engine base URL), ``block_size``,
    ``metrics`` ({backend: metrics URL}), ``metrics_interval_s``, ``tier_credit`` ({gpu, cpu, disk}: credit of a
    block held in that cache tier, read by ``tier_credit_of`` when the group's index is built). Raises
    ``ConfigError`` naming the key.
    """
    from kvroute.plugin.feeds.tokenizing import EngineTokenizer, LocalTokenizer
    from kvroute.policies.errors import ConfigError

    at = where or f"groups.{group}.precise"
    if not isinstance(config, Mapping):
        raise ConfigError(at, "must be a mapping")
    unknown = set(config) - _GROUP_KEYS
    if unknown:
        raise ConfigError(f"{at}.{sorted(unknown)[0]}", "unknown key")
    sources: list[EventSource] = []
    for i, raw in enumerate(config.get("sources") or []):
        key = f"{at}.sources[{i}]"
        if not isinstance(raw, Mapping) or not isinstance(raw.get("endpoint"), str):
            raise ConfigError(key, "needs an 'endpoint' string")
        bad = set(raw) - _SOURCE_KEYS
        if bad:
            raise ConfigError(f"{key}.{sorted(bad)[0]}", "unknown key")
        if raw.get("bind") is not None and not isinstance(raw.get("bind"), bool):
            raise ConfigError(f"{key}.bind", "must be true, false or absent")
        sources.append(EventSource(endpoint=raw["endpoint"], backend=raw.get("backend"), topic=raw.get("topic") or "",
                                   replay_endpoint=raw.get("replay_endpoint"), bind=raw.get("bind"),
                                   model=raw.get("model") or "", topic_backends=dict(raw.get("topic_backends") or {})))
    tier_credit_of(config, at)
    block_size = config.get("block_size")
    if block_size is not None and (type(block_size) is not int or block_size < 1):
        raise ConfigError(f"{at}.block_size", "must be a positive integer")
    tokenizer: PromptTokenizer | None = None
    if config.get("tokenize_url"):
        tokenizer = EngineTokenizer(str(config["tokenize_url"]), group, group=group)
    elif config.get("tokenizer"):
        tokenizer = LocalTokenizer(config["tokenizer"], config.get("tokenizer_config"), group=group)
    metrics = config.get("metrics") or {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"{at}.metrics", "must map backend names to /metrics URLs")
    return PreciseGroup(group, index, sources=sources, tokenizer=tokenizer, block_size=block_size,
                        metrics={str(k): str(v) for k, v in metrics.items()}, router=router,
                        metrics_interval_s=float(config.get("metrics_interval_s", 1.0)),
                        max_prefix_tokens=int(config.get("max_prefix_tokens", 131_072)))


def tier_credit_of(config: Mapping[str, Any], where: str) -> TierCredit:
    """The ``tier_credit`` of a group's ``precise:`` block (defaults where absent); ``ConfigError`` names the key."""
    return TierCredit.from_mapping(config.get("tier_credit"), f"{where}.tier_credit")
