"""The event-fed precise index: own keys from token ids, engine-hash removals, ref counts, speculation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import Router
from kvroute.policies.fingerprint import Fingerprinter, chain_seed, token_keys
from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig

BS = 16
SEED = chain_seed("m")
TOKENS = list(range(1000, 1000 + 8 * BS))


def request_keys(tokens=TOKENS, model="m", salt=None, bs=BS):
    return token_keys(tokens, bs, chain_seed(model, salt), 1 << 20)


def make(ttl=2.0):
    idx = PreciseIndex(PreciseIndexConfig(speculative_ttl_s=ttl))
    idx.attach("s1", "A")
    return idx


def test_stored_blocks_match_request_keys_whatever_the_engine_hashes():
    idx = make()
    assert idx.stored("s1", [0xDEAD0001, 0xDEAD0002, 0xDEAD0003], None, TOKENS[: 3 * BS], BS, SEED, "GPU") == 3
    assert idx.match(request_keys(), ["A", "B"], 0.0) == {"A": 3}
    assert idx.blocks("A") == 3
    # A different prompt shares no key; a different model seed never matches either.
    assert idx.match(request_keys(list(range(5000, 5000 + 4 * BS))), ["A"], 0.0) == {}
    assert idx.match(request_keys(model="other"), ["A"], 0.0) == {}


def test_parent_chain_continues_from_the_parents_own_key():
    idx = make()
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, SEED)
    idx.stored("s1", [3, 4], 2, TOKENS[2 * BS : 4 * BS], BS, SEED)
    assert idx.match(request_keys(), ["A"], 0.0) == {"A": 4}
    # The same blocks reached from a router-side fingerprint of the token ids match too.
    req = Fingerprinter().from_token_ids(TOKENS, model="m", block_size=BS)
    assert idx.match(req.keys, ["A"], 0.0) == {"A": 4}


def test_unknown_parent_is_an_orphan_and_not_stored():
    idx = make()
    assert idx.stored("s1", [7, 8], 999, TOKENS[: 2 * BS], BS, SEED) == 0
    assert idx.counters("s1").orphan_blocks == 2
    assert idx.blocks() == 0


def test_copies_are_reference_counted_per_copy_tag():
    idx = make()
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, SEED, copy="GPU")
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, SEED, copy="CPU")
    assert idx.removed("s1", [1, 2], copy="GPU") == 0
    assert idx.match(request_keys(), ["A"], 0.0) == {"A": 2}
    assert idx.removed("s1", [2], copy="CPU") == 1
    assert idx.match(request_keys(), ["A"], 0.0) == {"A": 1}
    # A duplicate announcement of the same copy needs two removals.
    idx.stored("s1", [1], None, TOKENS[:BS], BS, SEED, copy="GPU")
    idx.stored("s1", [1], None, TOKENS[:BS], BS, SEED, copy="GPU")
    assert idx.removed("s1", [1], copy="CPU") == 0
    assert idx.removed("s1", [1], copy="GPU") == 0
    assert idx.removed("s1", [1], copy="GPU") == 1
    assert idx.blocks("A") == 0
    assert idx.removed("s1", [42]) == 0 and idx.counters("s1").unknown_removals == 1


def test_removal_without_copy_tag_applies_to_a_single_copy():
    idx = make()
    idx.stored("s1", [1], None, TOKENS[:BS], BS, SEED, copy=("GPU", 0, None, None))
    assert idx.removed("s1", [1], copy=(None, None, None, None)) == 1
    assert idx.blocks() == 0


def test_several_sources_and_backends_share_keys_and_clear_independently():
    idx = make()
    idx.attach("s2", "A")  # a second DP rank of the same backend
    idx.attach("s3", "B")
    for src, base in (("s1", 10), ("s2", 20), ("s3", 30)):
        idx.stored(src, [base + 1, base + 2], None, TOKENS[: 2 * BS], BS, SEED)
    assert idx.match(request_keys(), ["A", "B"], 0.0) == {"A": 2, "B": 2}
    assert idx.holders(request_keys()[0]) == {"A": 2, "B": 1}
    assert idx.cleared("s1") == 2
    assert idx.match(request_keys(), ["A", "B"], 0.0) == {"A": 2, "B": 2}
    idx.cleared("s2")
    assert idx.match(request_keys(), ["A", "B"], 0.0) == {"B": 2}
    assert idx.blocks("A") == 0 and idx.blocks("B") == 2
    idx.detach("s3")
    assert idx.blocks() == 0 and not idx.covers("B")


def test_hash_only_store_of_a_new_block_is_skipped_but_adds_a_copy_of_a_known_one():
    idx = make()
    idx.stored("s1", [1], None, TOKENS[:BS], BS, SEED, copy="GPU")
    idx.stored("s1", [1, 2], None, [], BS, SEED, copy="CPU")
    assert idx.counters("s1").orphan_blocks == 1
    assert idx.removed("s1", [1], copy="GPU") == 0  # the CPU copy still holds it


def test_salt_and_lora_seed_separate_key_spaces():
    idx = make()
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, chain_seed("m", "tenant-a"))
    assert idx.match(request_keys(salt="tenant-a"), ["A"], 0.0) == {"A": 2}
    assert idx.match(request_keys(), ["A"], 0.0) == {}


def test_speculative_entries_expire_and_can_be_forgotten():
    idx = make(ttl=2.0)
    keys = request_keys()
    idx.record("A", keys[:4], now=10.0)
    assert idx.match(keys, ["A"], 11.0) == {"A": 4}
    assert idx.match(keys, ["A"], 12.5) == {}
    idx.record("A", keys[:4], now=20.0)
    idx.forget("A", keys[2:4])
    assert idx.match(keys, ["A"], 20.5) == {"A": 2}
    # Confirmed blocks and speculative ones combine into one leading run.
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, SEED)
    idx.record("A", keys[2:5], now=30.0)
    assert idx.match(keys, ["A"], 30.5) == {"A": 5}
    assert idx.speculative_blocks("A") >= 3


def test_uncovered_backends_use_the_approximate_fallback():
    idx = make()
    keys = request_keys()
    idx.record("B", keys, now=0.0)
    assert idx.match(keys, ["A", "B"], 1.0) == {"B": 8}
    idx.confirm("B", keys, cached_blocks=8, now=1.0, predicted_blocks=8)
    idx.forget("B", keys[4:])
    assert idx.match(keys, ["B"], 1.0) == {"B": 4}
    assert idx.blocks("B") == 4
    idx.set_capacity("B", 2 * 64)
    assert idx.fallback.capacity_blocks("B") == 2
    assert idx.retain(["A"]) == ["B"]


def test_remove_backend_drops_its_confirmed_and_speculative_state():
    idx = make()
    idx.stored("s1", [1, 2], None, TOKENS[: 2 * BS], BS, SEED)
    idx.record("A", request_keys(), now=0.0)
    idx.remove_backend("A")
    assert idx.match(request_keys(), ["A"], 0.0) == {}
    assert idx.blocks() == 0


def test_source_bound_and_bad_input_are_safe():
    idx = PreciseIndex(PreciseIndexConfig(max_blocks_per_source=2))
    idx.attach("s1", "A")
    idx.stored("s1", [1, 2, 3], None, TOKENS[: 3 * BS], BS, SEED)
    assert idx.blocks("A") == 2 and idx.counters("s1").dropped_blocks == 1
    assert idx.stored("unknown", [1], None, TOKENS[:BS], BS, SEED) == 0
    assert idx.stored("s1", [9], None, TOKENS[:BS], 0, SEED) == 0
    assert idx.match([], ["A"], 0.0) == {}


def test_router_with_precise_index_routes_to_the_engine_confirmed_holder():
    idx = PreciseIndex()
    idx.attach("a", "A")
    idx.attach("b", "B")
    tokens = list(range(4096))
    idx.stored("b", list(range(1, 65)), None, tokens, 64, chain_seed("m"))
    router = Router(index=idx)
    req = Fingerprinter().from_token_ids([*tokens, 1, 2, 3], model="m", block_size=64, request_id="r1")
    decision = router.pick(req, ["A", "B"])
    assert decision.backend == "B" and decision.matched_blocks == 64
    assert idx.speculative_blocks("B") == 64


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(["s1", "s2"]),
                          st.integers(0, 5), st.sampled_from(["GPU", "CPU"])), max_size=40))
def test_refcounts_agree_with_a_model(ops):
    """After any sequence of events, the held blocks equal those with a live copy in some source."""
    idx = PreciseIndex()
    idx.attach("s1", "A")
    idx.attach("s2", "A")
    blocks = [TOKENS[i * BS : (i + 1) * BS] for i in range(6)]
    copies: dict[tuple[str, int], dict[str, int]] = {}
    for op, src, i, medium in ops:
        if op == "store":
            idx.stored(src, [100 + i], None, blocks[i], BS, SEED, copy=medium)
            c = copies.setdefault((src, i), {})
            c[medium] = c.get(medium, 0) + 1
        elif op == "remove":
            idx.removed(src, [100 + i], copy=medium)
            c = copies.get((src, i))
            if c:
                if medium in c:
                    c[medium] -= 1
                    if not c[medium]:
                        del c[medium]
                elif len(c) == 1:  # a removal naming another medium applies to the only copy kind
                    (only,) = c
                    c[only] -= 1
                    if not c[only]:
                        del c[only]
                if not c:
                    del copies[(src, i)]
        else:
            idx.cleared(src)
            for key in [k for k in copies if k[0] == src]:
                del copies[key]
    held = {i for (_, i) in copies}
    for i in range(6):
        key = token_keys(blocks[i], BS, SEED, 1)[0]
        assert (idx.holders(key) != {}) == (i in held)
    assert idx.blocks("A") == len(held)


def test_keyed_chain_event_keys_match_keyed_request_keys_and_removals_use_engine_hashes():
    from kvroute.policies.fingerprint import ChainKey, FingerprintConfig

    key = ChainKey(b"k" * 32)
    idx = PreciseIndex(PreciseIndexConfig(chain=key))
    idx.attach("s1", "A")
    seed = chain_seed("m", "t-1", idx.chain)
    idx.stored("s1", [11, 12, 13], None, TOKENS[: 3 * BS], BS, seed)
    fp = Fingerprinter(FingerprintConfig(token_block_size=BS, chain=key))
    keyed = fp.from_token_ids(TOKENS, model="m", salt="t-1").keys
    assert idx.match(keyed, ["A"], 0.0) == {"A": 3}
    assert idx.match(request_keys(salt="t-1"), ["A"], 0.0) == {}  # the unkeyed chain of the same tokens misses
    idx.removed("s1", [13])  # the engine's own hash still finds the block to remove
    assert idx.match(keyed, ["A"], 0.0) == {"A": 2}
