"""Request fingerprinting: canonical prompt bytes (or token ids) cut into blocks and chain-hashed.

Keys are XXH3-64 chains seeded by the model name and an optional tenant salt:
``k0 = xxh3(block0, seed=xxh3(model ‖ 0 ‖ salt))``, ``k_i = xxh3(block_i, seed=k_{i-1})``. They are equal
across processes and machines (no Python ``hash()``), and tenants with different salts never share keys.
"""

from __future__ import annotations

import itertools
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvroute.policies.render import render_request, to_bytes
from kvroute.policies.request import RoutingRequest

_xxh3 = xxhash.xxh3_64_intdigest
_REQUEST_PREFIX = os.urandom(6).hex()
_request_counter = itertools.count(1)


def new_request_id() -> str:
    """A process-unique request id (random per process prefix + counter); cheaper than uuid4."""
    return f"kvr-{_REQUEST_PREFIX}-{next(_request_counter)}"

SESSION_METADATA_KEYS = ("session_id", "conversation_id", "thread_id")
SESSION_HEADERS = ("x-session-id", "x-session-affinity", "x-conversation-id")


@dataclass(frozen=True, slots=True)
class FingerprintConfig:
    """How prompts are cut: ``block_bytes`` per block (about 64 tokens at 4 bytes/token by default)."""

    block_bytes: int = 256
    bytes_per_token: float = 4.0
    max_prefix_tokens: int = 131_072
    token_block_size: int = 64

    def __post_init__(self) -> None:
        if self.block_bytes < 16:
            raise ValueError("block_bytes must be at least 16")
        if self.bytes_per_token <= 0:
            raise ValueError("bytes_per_token must be positive")
        if self.token_block_size < 1:
            raise ValueError("token_block_size must be at least 1")


def chain_seed(model: str, salt: str | None = None) -> int:
    """Seed of a key chain: the model name and the tenant salt, so isolated tenants never share keys."""
    return _xxh3(to_bytes(model) + b"\x00" + to_bytes(salt or ""))


def chain_keys(data: bytes | memoryview, block_bytes: int, seed: int, max_blocks: int) -> list[int]:
    """Chain-hash the full blocks of ``data`` without copying it; a trailing partial block is skipped."""
    view = memoryview(data)
    nblocks = min(len(view) // block_bytes, max_blocks)
    keys: list[int] = []
    append = keys.append
    h = seed
    end = nblocks * block_bytes
    for start in range(0, end, block_bytes):
        h = _xxh3(view[start : start + block_bytes], h)
        append(h)
    return keys


def token_keys(token_ids: Sequence[int], block_size: int, seed: int, max_blocks: int) -> list[int]:
    """Chain keys over token ids packed as little-endian uint32, ``block_size`` tokens per block."""
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError):
        packed = array("I", (int(t) & 0xFFFFFFFF for t in token_ids))
    if packed.itemsize != 4:  # pragma: no cover - platforms where 'I' is not 32-bit
        packed = array("L", packed)
    return chain_keys(packed.tobytes(), block_size * packed.itemsize, seed, max_blocks)


def _session_value(kwargs: Mapping[str, Any], headers: Mapping[str, str] | None) -> str | None:
    for meta_name in ("metadata", "litellm_metadata"):
        meta = kwargs.get(meta_name)
        if isinstance(meta, Mapping):
            for key in SESSION_METADATA_KEYS:
                if meta.get(key):
                    return str(meta[key])
    if headers:
        lowered = {str(k).lower(): v for k, v in headers.items()}
        for key in SESSION_HEADERS:
            if lowered.get(key):
                return str(lowered[key])
    for key in ("session_id", "conversation_id", "user"):
        if kwargs.get(key):
            return str(kwargs[key])
    return None


def session_key(kwargs: Mapping[str, Any], headers: Mapping[str, str] | None = None,
                tenant: str | None = None) -> str | None:
    """Salted hash of the request's session id (metadata, header or ``user``), scoped by tenant; None if absent."""
    session = _session_value(kwargs, headers)
    if session is None:
        return None
    return xxhash.xxh3_64_hexdigest(to_bytes((tenant or "") + "\x00" + session))


class Fingerprinter:
    """Builds ``RoutingRequest`` objects from OpenAI-style kwargs. Never raises on bad input."""

    def __init__(self, config: FingerprintConfig | None = None) -> None:
        self.config = config or FingerprintConfig()
        self._max_blocks_bytes = max(
            1, int(self.config.max_prefix_tokens * self.config.bytes_per_token) // self.config.block_bytes
        )
        self._block_tokens = self.config.block_bytes / self.config.bytes_per_token
        self._seeds: dict[tuple[str, str | None], int] = {}

    def seed(self, model: str, salt: str | None) -> int:
        cached = self._seeds.get((model, salt))
        if cached is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            cached = self._seeds[(model, salt)] = chain_seed(model, salt)
        return cached

    def from_kwargs(
        self,
        kwargs: Mapping[str, Any],
        *,
        model: str | None = None,
        tenant: str | None = None,
        isolate_tenant: bool = False,
        app: str | None = None,
        headers: Mapping[str, str] | None = None,
        request_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> RoutingRequest:
        """Fingerprint one request; the prompt is rendered exactly once and joined exactly once."""
        notes: list[str] = []
        try:
            kw: Mapping[str, Any] = kwargs if isinstance(kwargs, Mapping) else {}
            model_name = str(model if model is not None else kw.get("model") or "")
            salt_parts = [tenant] if (isolate_tenant and tenant) else []
            if kw.get("cache_salt"):
                salt_parts.append(str(kw.get("cache_salt")))
            seed = self.seed(model_name, "\x00".join(salt_parts) or None)
            rendered = render_request(kw)
            notes.extend(rendered.notes)
            if rendered.token_ids is not None:
                bs = self.config.token_block_size
                max_blocks = max(1, self.config.max_prefix_tokens // bs)
                keys = token_keys(rendered.token_ids, bs, seed, max_blocks)
                prompt_tokens = len(rendered.token_ids)
                block_tokens: float = bs
                key_space = "tokens"
            else:
                data = b"".join(rendered.segments)
                keys = chain_keys(data, self.config.block_bytes, seed, self._max_blocks_bytes)
                prompt_tokens = int(len(data) / self.config.bytes_per_token)
                block_tokens = self._block_tokens
                key_space = "bytes"
            return RoutingRequest(
                model=model_name,
                keys=keys,
                block_tokens=block_tokens,
                prompt_tokens=prompt_tokens,
                session_key=session_key(kw, headers, tenant),
                tenant=tenant,
                app=app,
                tags=dict(tags or {}),
                request_id=request_id or new_request_id(),
                kind=rendered.kind,
                notes=tuple(notes),
                key_space=key_space,
            )
        except Exception as exc:  # the public API never raises: an empty fingerprint routes by load
            notes.append(f"fingerprint_error:{type(exc).__name__}")
            return RoutingRequest(
                model=str(model or ""),
                keys=[],
                block_tokens=self._block_tokens,
                prompt_tokens=0,
                tenant=tenant,
                app=app,
                request_id=request_id or new_request_id(),
                kind="invalid",
                notes=tuple(notes),
            )

    def from_token_ids(
        self,
        token_ids: Sequence[int],
        *,
        model: str,
        block_size: int | None = None,
        salt: str | None = None,
        **fields: Any,
    ) -> RoutingRequest:
        """Fingerprint a prompt that is already tokenized (precise mode and token-id traces)."""
        bs = block_size or self.config.token_block_size
        keys = token_keys(token_ids, bs, self.seed(model, salt), max(1, self.config.max_prefix_tokens // bs))
        return RoutingRequest(
            model=model,
            keys=keys,
            block_tokens=bs,
            prompt_tokens=len(token_ids),
            key_space="tokens",
            request_id=fields.pop("request_id", None) or new_request_id(),
            **fields,
        )
