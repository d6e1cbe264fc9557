"""Credit by cache tier in the precise index: copies per tier, GPU → CPU moves, credited matches, the pick."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import Router
from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import Fingerprinter, chain_seed, token_keys
from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig
from kvroute.policies.tiers import DISK, GPU, HOST, TierCredit, TieredMatch, tier_of

BS = 16
SEED = chain_seed("m")
TOKENS = list(range(1000, 1000 + 8 * BS))
KEYS = token_keys(TOKENS, BS, SEED, 1 << 20)
HASHES = list(range(1, 9))


def make(credit: TierCredit | None = None, ttl: float = 2.0) -> PreciseIndex:
    idx = PreciseIndex(PreciseIndexConfig(speculative_ttl_s=ttl, tier_credit=credit or TierCredit()))
    idx.attach("s1", "A")
    return idx


def gpu_store(idx: PreciseIndex, source: str = "s1", n: int = 8) -> None:
    idx.stored(source, HASHES[:n], None, TOKENS[: n * BS], BS, SEED, copy="GPU", tier=GPU)


def offload(idx: PreciseIndex, hashes: list[int], tier: int = HOST, source: str = "s1") -> None:
    """A connector's tokenless copy of blocks the engine already announced (vLLM's offloading connector)."""
    idx.stored(source, hashes, None, [], 0, SEED, copy=("CPU" if tier == HOST else "DISK"), tier=tier)


def credited(match: dict[str, int]) -> dict[str, float]:
    return match.credited if isinstance(match, TieredMatch) else {}


def test_gpu_only_answers_stay_plain_dicts():
    idx = make()
    gpu_store(idx)
    match = idx.match(KEYS, ["A"], 0.0)
    assert match == {"A": 8} and type(match) is dict


def test_a_block_moved_gpu_to_cpu_is_still_held_at_host_credit():
    idx = make()
    gpu_store(idx)
    offload(idx, HASHES)
    assert type(idx.match(KEYS, ["A"], 0.0)) is dict  # best copy still on the GPU: full credit
    assert idx.removed("s1", HASHES, copy="GPU") == 0  # the GPU copies go; the CPU copies stay
    match = idx.match(KEYS, ["A"], 0.0)
    assert match == {"A": 8} and credited(match) == {"A": 6.0}
    assert idx.blocks("A") == 8
    assert idx.removed("s1", HASHES, copy="CPU") == 8
    assert idx.match(KEYS, ["A"], 0.0) == {} and idx.blocks("A") == 0


def test_removal_of_one_medium_leaves_the_other_tiers_copy():
    idx = make()
    gpu_store(idx)
    offload(idx, HASHES)
    assert idx.removed("s1", HASHES, copy="CPU") == 0
    match = idx.match(KEYS, ["A"], 0.0)
    assert match == {"A": 8} and type(match) is dict  # GPU copies untouched, nothing left in a slow tier
    assert idx.removed("s1", HASHES[4:], copy="GPU") == 4
    assert idx.match(KEYS, ["A"], 0.0) == {"A": 4}


def test_mixed_prefix_sums_each_blocks_best_tier():
    idx = make()
    gpu_store(idx)
    offload(idx, HASHES[2:])  # blocks 2..7 also in host memory
    offload(idx, HASHES[6:], tier=DISK)  # blocks 6..7 also on disk
    idx.removed("s1", HASHES[4:], copy="GPU")  # GPU keeps 0..3
    # 4 GPU blocks + 4 host blocks (the disk copies of 6..7 are the slower of two)
    assert credited(idx.match(KEYS, ["A"], 0.0)) == {"A": 4 + 4 * 0.75}
    idx.removed("s1", HASHES[6:], copy="CPU")
    assert credited(idx.match(KEYS, ["A"], 0.0)) == {"A": 4 + 2 * 0.75 + 2 * 0.25}
    # A shorter request only reads its own leading blocks.
    assert idx.match(KEYS[:4], ["A"], 0.0) == {"A": 4} and type(idx.match(KEYS[:4], ["A"], 0.0)) is dict


def test_gpu_copy_reloaded_from_cpu_gets_full_credit_back():
    idx = make()
    gpu_store(idx)
    offload(idx, HASHES)
    idx.removed("s1", HASHES, copy="GPU")
    assert credited(idx.match(KEYS, ["A"], 0.0)) == {"A": 6.0}
    gpu_store(idx)  # a request loaded the prefix back: the engine announces the GPU blocks again
    match = idx.match(KEYS, ["A"], 0.0)
    assert match == {"A": 8} and type(match) is dict


def test_another_source_of_the_backend_holding_gpu_copies_wins():
    idx = make()
    idx.attach("s2", "A")  # a second DP rank of the same backend
    gpu_store(idx)
    offload(idx, HASHES)
    idx.removed("s1", HASHES, copy="GPU")
    gpu_store(idx, "s2", 4)
    assert credited(idx.match(KEYS, ["A"], 0.0)) == {"A": 4 + 4 * 0.75}
    idx.cleared("s2")
    assert credited(idx.match(KEYS, ["A"], 0.0)) == {"A": 6.0}
    idx.cleared("s1")
    assert idx.match(KEYS, ["A"], 0.0) == {} and not idx._slow


def test_speculative_entry_counts_as_a_gpu_block():
    idx = make()
    gpu_store(idx)
    offload(idx, HASHES)
    idx.removed("s1", HASHES, copy="GPU")
    idx.record("A", KEYS[:2], 0.0)  # a pick sent there is loading these into the GPU now
    assert credited(idx.match(KEYS, ["A"], 1.0)) == {"A": 2 + 6 * 0.75}
    assert credited(idx.match(KEYS, ["A"], 5.0)) == {"A": 6.0}  # expired


def test_credits_are_configurable_and_approximate_backends_are_untouched():
    idx = make(TierCredit(cpu=0.8))  # llm-d's weights
    gpu_store(idx)
    offload(idx, HASHES)
    idx.removed("s1", HASHES, copy="GPU")
    idx.fallback.record("B", KEYS[:3], 0.0)
    match = idx.match(KEYS, ["A", "B"], 0.0)
    assert match == {"A": 8, "B": 3} and match.credited == pytest.approx({"A": 6.4})
    discounted = make(TierCredit(gpu=0.5))
    gpu_store(discounted)
    assert credited(discounted.match(KEYS, ["A"], 0.0)) == {"A": 4.0}


def test_tier_names_and_config_errors():
    assert [tier_of(m) for m in (None, "", "GPU", "cuda", "CPU", "cpu", "CXL", "STORAGE", "disk", "weird")] == [
        GPU, GPU, GPU, GPU, HOST, HOST, HOST, DISK, DISK, DISK]
    assert TierCredit.from_mapping(None) == TierCredit(1.0, 0.75, 0.25)
    assert TierCredit.from_mapping({"cpu": 0.8}).by_tier == (1.0, 0.8, 0.25)
    with pytest.raises(ConfigError) as exc:
        TierCredit.from_mapping({"cpu": 1.5}, "kvroute.groups.g.precise.tier_credit")
    assert exc.value.key == "kvroute.groups.g.precise.tier_credit.cpu"
    with pytest.raises(ConfigError) as exc:
        TierCredit.from_mapping({"hbm": 1.0})
    assert exc.value.key == "tier_credit.hbm"
    with pytest.raises(ConfigError):
        TierCredit.from_mapping({"disk": True})
    with pytest.raises(ConfigError):
        TierCredit.from_mapping([0.5])  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(["s1", "s2"]),
                          st.integers(0, 3), st.sampled_from([GPU, HOST, DISK])), max_size=50))
def test_credited_prefix_agrees_with_a_model(ops):
    """After any events, each leading block counts at the best tier of any live copy on the backend."""
    idx = make()
    idx.attach("s2", "A")
    tags = {GPU: "GPU", HOST: "CPU", DISK: "DISK"}
    live: dict[tuple[str, int], dict[int, int]] = {}  # (source, block) -> {tier: copies}
    for op, src, i, tier in ops:
        if op == "store":
            # A block's first copy carries tokens; later ones may be tokenless (connector copies).
            idx.stored(src, [HASHES[i]], None if i == 0 else HASHES[i - 1], TOKENS[i * BS:(i + 1) * BS], BS, SEED,
                       copy=tags[tier], tier=tier)
            if i == 0 or (src, i - 1) in live or (src, i) in live:
                c = live.setdefault((src, i), {})
                c[tier] = c.get(tier, 0) + 1
        elif op == "remove":
            idx.removed(src, [HASHES[i]], copy=tags[tier])
            c = live.get((src, i))
            if c:
                if tier in c:
                    c[tier] -= 1
                    if not c[tier]:
                        del c[tier]
                elif len(c) == 1:  # a removal naming another copy applies to the only kind held
                    (only,) = c
                    c[only] -= 1
                    if not c[only]:
                        del c[only]
                if not c:
                    del live[(src, i)]
        else:
            idx.cleared(src)
            for key in [k for k in live if k[0] == src]:
                del live[key]
    credit = TierCredit().by_tier
    expected_blocks, expected_credit = 0, 0.0
    for i in range(4):
        tiers = [t for (s, j), c in live.items() if j == i for t in c]
        if not tiers:
            break
        expected_blocks += 1
        expected_credit += credit[min(tiers)]
    match = idx.match(KEYS[:4], ["A"], 0.0)
    assert match.get("A", 0) == expected_blocks
    assert credited(match).get("A", float(expected_blocks)) == pytest.approx(expected_credit)


def test_pick_prefers_gpu_holder_then_cpu_holder_then_none_at_equal_load():
    tokens = list(range(4096))
    hashes = list(range(1, 65))

    def fleet() -> tuple[PreciseIndex, Router]:
        idx = PreciseIndex()
        for b in ("G", "C", "N"):
            idx.attach(b.lower(), b)
        idx.stored("g", hashes, None, tokens, 64, chain_seed("m"), copy="GPU", tier=GPU)
        idx.stored("c", hashes, None, tokens, 64, chain_seed("m"), copy="GPU", tier=GPU)
        idx.stored("c", hashes, None, [], 0, chain_seed("m"), copy="CPU", tier=HOST)
        idx.removed("c", hashes, copy="GPU")  # C's copy moved to host memory
        return idx, Router(index=idx)

    def pick(candidates: list[str]):
        _, router = fleet()
        req = Fingerprinter().from_token_ids([*tokens, 7, 8, 9], model="m", block_size=64, request_id="r")
        return router.pick(req, candidates)

    best = pick(["N", "C", "G"])
    assert best.backend == "G" and best.reason == "prefix_match" and best.matched_tokens == 4096
    second = pick(["N", "C"])
    assert second.backend == "C" and second.reason == "prefix_match"
    # held tokens are reported (the engine counts host-loaded tokens as cached); the cost reads them at 0.75
    assert second.matched_blocks == 64 and second.matched_tokens == 4096
    assert second.predicted_prefill_tokens == 4099 - int(0.75 * 4096)
    assert second.scores["C"] < second.scores["N"]  # cheaper than recomputing...
    assert best.scores["G"] < best.scores["C"]  # ...dearer than a GPU hit
