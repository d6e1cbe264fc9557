"""Decoding KV-event batches: both event encodings, both hash encodings, garbage, recorded vLLM payloads."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvroute.plugin.feeds.kvevents_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    normalize_hash,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kvevents"
enc = msgspec.msgpack.encode


def test_tagged_map_events_as_vllm_emits_since_mid_2026():
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "extra_keys": [None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention", "some_future_field": {"x": 1}},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "payload": 3},
    ]
    batch = decode_batch(enc([1700000000.5, events, 1]))
    assert batch.dp_rank == 1 and batch.ts == 1700000000.5
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.hashes == [1, 2**64 - 1] and stored.parent is None
    assert stored.block_size == 16 and stored.medium == "GPU" and stored.group_idx == 0
    assert isinstance(removed, BlockRemoved) and removed.hashes == [2]
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.unknown_events == 1 and batch.bad_events == 0


def test_positional_array_events_as_older_vllm_and_sglang_emit():
    events = [
        ["BlockStored", [10, 11], 9, list(range(32)), 16, None, "CPU", "my-lora", [["cache_salt", "t1"], None]],
        ["BlockStored", [12], 11, list(range(16)), 16],  # trailing defaults omitted
        ["BlockRemoved", [10], "CPU"],
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(enc([1.0, events]))  # dp rank omitted
    assert batch.dp_rank == 0
    first, second, removed, _ = batch.events
    assert first.parent == 9 and first.lora_name == "my-lora" and first.medium == "CPU"
    assert first.salt is None  # a salt is only read from block 0 of a sequence start
    assert second.hashes == [12] and second.medium is None
    assert removed.medium == "CPU"


def test_cache_salt_from_block_zero_extra_keys():
    tagged = ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None, [[["cache_salt", "abc"]]]]
    untagged = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
                "block_size": 16, "lora_name": "lora-x", "extra_keys": [["lora-x", "salty"]]}
    assert decode_batch(enc([0.0, [tagged]])).events[0].salt == "abc"
    assert decode_batch(enc([0.0, [untagged]])).events[0].salt == "salty"


def test_hashes_as_bytes_use_the_last_eight_bytes_big_endian():
    digest = bytes(range(32))
    assert normalize_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert normalize_hash(-1) == 2**64 - 1
    with pytest.raises(ValueError):
        normalize_hash(b"")
    with pytest.raises(ValueError):
        normalize_hash("abc")
    event = {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest[::-1],
             "token_ids": list(range(16)), "block_size": 16}
    stored = decode_batch(enc([0.0, [event]])).events[0]
    assert stored.hashes == [normalize_hash(digest)] and stored.parent == normalize_hash(digest[::-1])


def test_batch_as_a_map_is_accepted():
    batch = decode_batch(enc({"ts": 2.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3}))
    assert batch.dp_rank == 3 and len(batch.events) == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1garbage", enc("just a string"), enc([1.0]), enc(["ts", []]),
                                     enc([1.0, "not a list"]), enc({"ts": 1.0})])
def test_garbage_batches_raise_a_decode_error(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_bad_events_are_counted_and_skipped():
    events = [
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": [], "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 0},  # tokens, no size
        {"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 16},
        {"type": "BlockRemoved", "block_hashes": None},
        42,
        [],
        ["BlockRemoved", [5]],
    ]
    batch = decode_batch(enc([0.0, events]))
    assert batch.bad_events == 6 and len(batch.events) == 1


def test_recorded_vllm_batches_decode():
    path = FIXTURES / "vllm-0.32-cpu-batches.msgpack"
    assert path.exists(), f"recorded fixture {path} absent (captured with bench/vllm_precise_e2e.py --capture)"
    records = msgspec.msgpack.decode(path.read_bytes())
    stored = removed = 0
    for _source, _seq, payload in records:
        batch = decode_batch(payload)
        assert batch.bad_events == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += len(ev.hashes)
                assert ev.block_size > 0 and len(ev.token_ids) == ev.block_size * len(ev.hashes)
            elif isinstance(ev, BlockRemoved):
                removed += len(ev.hashes)
    assert stored > 0 and removed > 0
