"""Decoding of engine KV-cache event batches (vLLM, SGLang) from their msgpack wire form.

A batch is ``[ts, events, dp_rank?]`` (or, defensively, a map with those names). Each event is either a
positional array tagged by its first element (older vLLM, SGLang) or a map tagged by ``"type"`` (vLLM
since mid-2026). Unknown event types and unknown fields are ignored; hashes are normalised to uint64
(ints masked, bytes → last 8 bytes big-endian).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

MASK64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()

# Positional field order after the tag, as vLLM's array_like structs (and SGLang's port) lay them out.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality", "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class EventDecodeError(ValueError):
    """A payload that is not a KV-event batch at all (the whole batch is skipped)."""


@dataclass(slots=True)
class BlockStored:
    hashes: list[int]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    salt: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int
    bad_events: int = 0
    unknown_events: int = 0


def normalize_hash(value: Any) -> int:
    """An engine block hash as uint64: ints masked to 64 bits, bytes → their last 8 bytes big-endian."""
    if type(value) is int:
        return value & MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise ValueError("empty hash")
        return int.from_bytes(raw[-8:], "big")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"hash of type {type(value).__name__}")
    return int(value) & MASK64


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("block_hashes is not a list")
    try:
        return [h & MASK64 for h in value]  # fast path: plain ints
    except TypeError:
        return [normalize_hash(h) for h in value]


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: Any) -> int | None:
    return value if type(value) is int else None


def _salt(extra_keys: Any, lora_name: str | None, parent: int | None) -> str | None:
    """The cache salt from block 0's extra keys: tagged ``("cache_salt", s)`` or, untagged, a lone string."""
    if parent is not None or not isinstance(extra_keys, (list, tuple)) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    for item in first:
        if isinstance(item, (list, tuple)) and len(item) == 2 and item[0] == "cache_salt" and isinstance(item[1], str):
            return item[1]
    strings = [x for x in first if isinstance(x, str) and x != lora_name]
    return strings[-1] if strings else None


def _fields(raw: Any, names: tuple[str, ...]) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def decode_event(raw: Any) -> Event | None:
    """One event in either encoding; None for an unknown type. Raises ``ValueError`` when malformed."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
    else:
        raise ValueError("event is neither a map nor a tagged array")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        hashes = _hashes(f.get("block_hashes"))
        parent_raw = f.get("parent_block_hash")
        parent = None if parent_raw is None else normalize_hash(parent_raw)
        tokens = f.get("token_ids") or []
        if not isinstance(tokens, (list, tuple)):
            raise ValueError("token_ids is not a list")
        block_size = f.get("block_size")
        # Offloading connectors announce tokenless ("hash-only") copies, some with block size 0.
        if type(block_size) is not int or block_size < 0 or (block_size == 0 and tokens):
            raise ValueError("block_size is not a positive int")
        lora_name = _opt_str(f.get("lora_name"))
        return BlockStored(hashes, parent, tokens, block_size, lora_name, _opt_str(f.get("medium")),
                           _salt(f.get("extra_keys"), lora_name, parent), _opt_int(f.get("group_idx")),
                           _opt_str(f.get("locality")), _opt_str(f.get("ownership")))
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(_hashes(f.get("block_hashes")), _opt_str(f.get("medium")), _opt_int(f.get("group_idx")),
                            _opt_str(f.get("locality")), _opt_str(f.get("ownership")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode one batch; a bad payload raises ``EventDecodeError``, a bad event is counted and skipped."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError("batch is not [ts, events, dp_rank?]")
    if not isinstance(events, (list, tuple)) or isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError("batch has no event list or timestamp")
    batch = EventBatch(float(ts), [], rank if type(rank) is int and rank >= 0 else 0)
    for item in events:
        try:
            event = decode_event(item)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):
            batch.bad_events += 1
            continue
        if event is None:
            batch.unknown_events += 1
        else:
            batch.events.append(event)
    return batch
