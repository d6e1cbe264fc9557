"""Cache tiers on the wire: events encoded by msgspec as vLLM's publisher encodes them, with and without
``medium``, applied by the feed to the precise index (GPU → CPU offload, per-medium removals, block size)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
from kvroute.plugin.feeds.kvevents_wire import BlockStored as Decoded
from kvroute.plugin.feeds.kvevents_wire import decode_batch
from kvroute.plugin.settings import KvrouteSettings
from kvroute.policies.fingerprint import chain_seed, token_keys
from kvroute.policies.precise_index import PreciseIndex
from kvroute.policies.tiers import TierCredit, TieredMatch

BS = 16
TOKENS = list(range(500, 500 + 6 * BS))
KEYS = token_keys(TOKENS, BS, chain_seed("m"), 1 << 20)
HASHES = [2**64 - 6 + i for i in range(6)]  # uint64 hashes above 2^63, as vLLM's default encoding yields


def vllm_structs(array_like: bool) -> tuple[type, type, type]:
    """vLLM's ``vllm/distributed/kv_events.py`` structs: ``array_like`` (positional, before vLLM's map
    encoding) or tagged maps (since mid-2026); ``omit_defaults`` drops trailing defaults either way."""

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None = None
        medium: str | None = None
        lora_name: str | None = None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None = None
        group_idx: int | None = None

    return EventBatch, BlockStored, BlockRemoved


@pytest.fixture(params=[True, False], ids=["positional", "tagged-map"])
def wire(request):
    batch_cls, stored_cls, removed_cls = vllm_structs(request.param)
    index = PreciseIndex()
    sizes: list[tuple[str, int]] = []
    feed = KvEventFeed(index, [EventSource("inproc://tiers", backend="A", topic="kv", model="m")],
                       on_block_size=lambda backend, size: sizes.append((backend, size)))
    stream = feed._stream(0, b"kv")
    seq = iter(range(1000))

    def send(*events: Any) -> None:
        payload = msgspec.msgpack.encode(batch_cls(ts=1.0, events=list(events)))
        feed.ingest(stream, next(seq), payload, live=True)

    return send, stored_cls, removed_cls, index, feed, sizes


def credited(match: dict[str, int]) -> dict[str, float]:
    return match.credited if isinstance(match, TieredMatch) else {}


def test_gpu_to_cpu_offload_then_gpu_eviction_leaves_a_host_tier_copy(wire):
    send, Stored, Removed, index, feed, sizes = wire
    send(Stored(HASHES, None, TOKENS, BS, medium="GPU"))
    # vLLM's offloading connector: tokenless copies of the same hashes, parent None, block size 0 in some builds
    send(Stored(HASHES, None, [], 0, medium="CPU"))
    assert feed.stat("kv").decode_errors == 0
    assert index.match(KEYS, ["A"], 0.0) == {"A": 6} and not credited(index.match(KEYS, ["A"], 0.0))
    send(Removed(HASHES[2:], medium="GPU"))  # the GPU blocks are reallocated; the CPU copies stay
    match = index.match(KEYS, ["A"], 0.0)
    assert match == {"A": 6} and credited(match) == {"A": 2 + 4 * 0.75}
    send(Removed(HASHES[4:], medium="CPU"))
    assert index.match(KEYS, ["A"], 0.0) == {"A": 4} and credited(index.match(KEYS, ["A"], 0.0)) == {"A": 3.5}
    assert sizes == [("A", BS)]  # only the GPU store taught the block size


def test_removal_of_cpu_copy_keeps_the_gpu_copy(wire):
    send, Stored, Removed, index, *_ = wire
    send(Stored(HASHES, None, TOKENS, BS, medium="GPU"), Stored(HASHES, None, [], BS, medium="CPU"))
    send(Removed(HASHES, medium="CPU"))
    match = index.match(KEYS, ["A"], 0.0)
    assert match == {"A": 6} and type(match) is dict


def test_events_without_medium_are_gpu_copies(wire):
    send, Stored, Removed, index, feed, sizes = wire
    send(Stored(HASHES, None, TOKENS, BS))  # older vLLM and SGLang: no medium
    decoded = decode_batch(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [], 0]]])).events
    assert isinstance(decoded[0], Decoded) and decoded[0].medium is None
    match = index.match(KEYS, ["A"], 0.0)
    assert match == {"A": 6} and type(match) is dict
    send(Removed(HASHES[3:], medium="GPU"))  # "GPU" names the same copy an absent medium stored
    assert index.match(KEYS, ["A"], 0.0) == {"A": 3}
    send(Stored(HASHES[:3], None, [], BS, medium="CPU"), Removed(HASHES[:3]))  # absent medium: the GPU copy
    assert credited(index.match(KEYS, ["A"], 0.0)) == {"A": 3 * 0.75}
    assert feed.stat("kv").decode_errors == 0 and sizes == [("A", BS)]


def test_lmcache_cpu_chunks_count_as_host_tier_and_do_not_change_the_block_size(wire):
    send, Stored, Removed, index, feed, sizes = wire
    send(Stored(HASHES[:2], None, TOKENS[: 2 * BS], BS, medium="GPU"))
    # LMCache's CPU backend publishes lower-case "cpu" and its own chunk size
    send(Stored([77], None, TOKENS[: 4 * BS], 4 * BS, medium="cpu"))
    send(Stored(HASHES[:2], None, [], BS, medium="cpu"), Removed(HASHES[:2], medium="GPU"))
    assert credited(index.match(KEYS, ["A"], 0.0)) == {"A": 1.5}
    assert sizes == [("A", BS)] and feed.block_sizes == {"A": BS}


def test_tokenful_store_with_zero_block_size_is_still_malformed():
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, list(range(16)), 0, None, "CPU"]]])
    assert decode_batch(payload).bad_events == 1


async def test_a_groups_tier_credit_setting_reaches_its_precise_index():
    groups = {"llama": {"mode": "precise", "precise": {"tokenize_url": "http://127.0.0.1:9",
                                                       "tier_credit": {"cpu": 0.8, "disk": 0.1}}},
              "other": {"mode": "precise", "precise": {"tokenize_url": "http://127.0.0.1:9"}}}
    cb = KvrouteCallback(KvrouteSettings(groups=groups).check_policies(), metrics=Metrics(CollectorRegistry()),
                         mount=False)
    try:
        assert cb.router_for("llama", []).index.config.tier_credit == TierCredit(1.0, 0.8, 0.1)
        assert cb.router_for("other", []).index.config.tier_credit == TierCredit()
    finally:
        await cb.aclose()
