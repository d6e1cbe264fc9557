"""Approximate prefix index: longest-prefix match, LRU at block granularity, TTL, bounded memory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.policies import PrefixIndex, PrefixIndexConfig


def chain(n: int, base: int = 0) -> list[int]:
    return [base * 1_000_000 + i for i in range(n)]


def test_longest_prefix_per_backend():
    idx = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 1000))
    keys = chain(20)
    idx.record("a", keys[:5], now=0)
    idx.record("b", keys[:12], now=0)
    idx.record("c", chain(3, base=9), now=0)
    assert idx.match(keys, ["a", "b", "c", "d"], now=1) == {"a": 5, "b": 12}
    assert idx.match(keys[:3], ["a", "b"], now=1) == {"a": 3, "b": 3}
    assert idx.match([], ["a"], now=1) == {}


def test_lru_evicts_tails_before_roots_and_respects_capacity():
    idx = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 10))
    idx.record("a", chain(8, base=1), now=0)
    idx.record("a", chain(6, base=2), now=1)  # 14 blocks > 10: oldest tail blocks of chain 1 go first
    assert idx.blocks("a") == 10
    held = idx.match(chain(8, base=1), ["a"], now=2)["a"]
    assert held == 4  # the root survives, the tail was evicted
    assert idx.match(chain(6, base=2), ["a"], now=2)["a"] == 6


def test_ttl_expires_entries():
    idx = PrefixIndex(PrefixIndexConfig(ttl_s=10))
    idx.record("a", chain(4), now=0)
    assert idx.match(chain(4), ["a"], now=5) == {"a": 4}
    assert idx.match(chain(4), ["a"], now=11) == {}
    idx.record("a", chain(2), now=11)
    assert idx.match(chain(4), ["a"], now=12) == {"a": 2}


def test_confirm_tracks_accuracy_and_leaves_capacity_alone_by_default():
    idx = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 100))
    idx.record("a", chain(10), now=0)
    idx.confirm("a", chain(10), cached_blocks=5, now=1, predicted_blocks=10)
    assert idx.accuracy("a") == 0.5 and idx.capacity_blocks("a") == 100


def test_confirm_shrinks_learned_capacity_on_overprediction_and_recovers():
    idx = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 100, learn_capacity=True))
    keys = chain(10)
    idx.record("a", keys, now=0)
    idx.confirm("a", keys, cached_blocks=0, now=1, predicted_blocks=10)
    assert idx.capacity_blocks("a") == 90
    assert idx.accuracy("a") == 0.0
    for _ in range(20):
        idx.confirm("a", keys, cached_blocks=10, now=2, predicted_blocks=10)
    assert idx.capacity_blocks("a") == 100
    assert idx.match(keys, ["a"], now=3) == {"a": 10}


def test_forget_remove_retain_and_set_capacity():
    idx = PrefixIndex()
    idx.record("a", chain(6), now=0)
    idx.record("b", chain(6), now=0)
    idx.forget("a", chain(6)[3:])
    assert idx.match(chain(6), ["a", "b"], now=1) == {"a": 3, "b": 6}
    idx.remove_backend("b")
    assert idx.match(chain(6), ["a", "b"], now=1) == {"a": 3}
    idx.record("c", chain(2), now=0)
    assert idx.retain(["c"]) == ["a"]
    idx.set_capacity("c", 64)
    assert idx.blocks("c") == 1


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 30), st.integers(1, 40)), max_size=80))
def test_memory_is_bounded_and_matches_are_prefix_lengths(ops):
    cap = 50
    idx = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * cap))
    for t, (backend, base, n) in enumerate(ops):
        idx.record(backend, chain(n, base), now=t)
        assert idx.blocks(backend) <= cap
        got = idx.match(chain(n, base), "abcd", now=t)
        assert got[backend] == n  # what was just recorded is fully visible
        for held in got.values():
            assert 1 <= held <= n
    assert idx.blocks() <= 4 * cap


def test_backend_count_is_bounded():
    idx = PrefixIndex(PrefixIndexConfig(max_backends=3))
    for b in "abcde":
        idx.record(b, chain(2), now=0)
    assert len(idx.backends()) == 3


def test_record_keeps_the_one_key_at_a_time_lru_order():
    import random
    from collections import OrderedDict

    from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig
    rng = random.Random(9)
    index = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 500, block_tokens=64.0))
    model: OrderedDict[int, float] = OrderedDict()
    for _ in range(300):
        keys = rng.sample(range(2000), rng.randrange(0, 60))
        index.record("a", keys, 0.0)
        for key in reversed(keys):
            if key in model:
                model.move_to_end(key)
            else:
                model[key] = float("inf")
        while len(model) > 500:
            model.popitem(last=False)
        assert list(index._backends["a"].entries) == list(model)


def test_holdings_equal_capacity_then_blocks_per_backend() -> None:
    from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig

    one = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 10, block_tokens=64.0, max_backends=3))
    two = PrefixIndex(PrefixIndexConfig(capacity_tokens=64 * 10, block_tokens=64.0, max_backends=3))
    for index in (one, two):
        index.record("a", [1, 2, 3], 0.0)
        index.record("b", [4], 0.0)
        index.set_capacity("b", 64 * 2)
    order = ["b", "new", "a", "other", "a"]  # unseen backends get a state (and evict the smallest at the cap)
    blocks, caps = one.holdings(order)
    alone = [(two.capacity_blocks(b), two.blocks(b)) for b in order]
    assert list(zip(caps, blocks, strict=True)) == alone
    assert sorted(one.backends()) == sorted(two.backends())
