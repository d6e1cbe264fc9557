"""The ``llamacpp`` engine preset: llama.cpp's host prompt cache of whole prompts and a one-slot replica."""

from __future__ import annotations

import pytest

from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.presets import get_preset
from kvroute.sim.prompt_cache import HostPromptCache, PromptCacheConfig, common_prefix
from kvroute.sim.replica import Live
from kvroute.sim.replica_llamacpp import LlamaCppReplica, SharedCores, tokens_of_keys
from kvroute.sim.workload import SimRequest, Workload


def cache(budget_tokens: int) -> HostPromptCache[tuple[int, ...]]:
    return HostPromptCache(PromptCacheConfig(budget_bytes=budget_tokens, state_bytes_per_token=1.0))


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# ---------------------------------------------------------------------------------------------- the prompt cache
def test_common_prefix_counts_leading_equal_elements():
    assert common_prefix((1, 2, 3, 4), (1, 2, 9)) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix((), (1,)) == 0 and common_prefix(b"abcx", b"abcy") == 3


def test_save_keeps_whole_prompts_drops_obsolete_ones_and_skips_what_an_entry_holds():
    c = cache(100)
    c.save(seq(0, 10))
    c.save(seq(0, 20))  # contains the first: the first is obsolete
    assert c.entries == [seq(0, 20)] and c.evicted == 0
    c.save(seq(0, 5))  # an entry already holds it
    assert c.entries == [seq(0, 20)]
    c.save(seq(1000, 101))  # alone over the budget: never stored
    assert c.entries == [seq(0, 20)] and c.used_tokens == 20


def test_eviction_is_lru_over_whole_prompts_not_blocks():
    c = cache(10)
    a, b, d = seq(0, 4), seq(100, 4), seq(200, 4)
    c.save(a)
    c.save(b)
    c.save(d)  # 12 > 10: the oldest prompt goes, whole
    assert c.entries == [b, d] and c.evicted == 1
    assert c.holds((*a, 7)) == 0 and c.holds(b) == 4


def test_restore_moves_the_best_entry_into_the_slot_and_out_of_the_cache():
    c = cache(100)
    a = seq(0, 8)
    c.save(a)
    prompt = (*a[:6], 99)
    held = c.restore(None, prompt)
    assert held == a and c.entries == [] and c.restored == 1
    assert c.reused(held, prompt) == 6
    assert c.reused(a, a) == 7  # never the prompt's last token


def test_restore_needs_a_quarter_of_the_entry_and_a_better_match_than_the_slot():
    c = cache(100)
    big = seq(0, 40)
    c.save(big)
    assert c.restore(None, (*big[:8], 99)) is None  # 8 of 40: under a quarter, the entry is not worth it
    assert c.entries == [big]
    slot = big[:30]
    assert c.restore(slot, (*big[:30], 99)) == slot  # the entry keeps a smaller share than the slot: stays
    assert c.entries == [big] and c.restored == 0


def test_take_saves_the_slot_restores_a_better_entry_and_trims():
    c = cache(12)
    a, b = seq(0, 6), seq(100, 6)
    c.save(a)
    held = c.take(b, (*a, 7))  # b is saved, a comes back into the slot
    assert held == a and c.entries == [b]
    c.entries = [seq(300, 6), seq(400, 6), seq(500, 6)]  # over budget (18 > 12): the trim drops the oldest
    c.trim()
    assert c.entries == [seq(400, 6), seq(500, 6)] and c.evicted == 1
    c.entries = [seq(600, 30)]
    c.trim()  # one entry always stays
    assert c.entries == [seq(600, 30)]


def test_a_zero_budget_caches_nothing():
    c = cache(0)
    c.save(seq(0, 5))
    assert c.entries == [] and c.take(seq(0, 5), seq(0, 6)) == seq(0, 5)  # the slot's own sequence still counts


def test_bytes_count_as_tokens_per_unit():
    c = HostPromptCache(PromptCacheConfig(budget_bytes=1000, state_bytes_per_token=10.0, tokens_per_unit=0.5))
    assert c.tokens(b"x" * 9) == 5 and c.config.budget_tokens == 100
    assert c.reused(b"abcdefgh", b"abcdefgz") == 3  # 7 shared bytes, 3.5 tokens, rounded down


# ---------------------------------------------------------------------------------------------- the replica
def _replica(cache_tokens: int = 4096, cores: SharedCores | None = None) -> LlamaCppReplica:
    preset = get_preset("llamacpp")
    assert preset.llamacpp is not None and preset.cost.max_running == 1
    return LlamaCppReplica("r0", preset.cost, PromptCacheConfig(cache_tokens * 4108, 4108.0),
                           preset.llamacpp.response_s, cores=cores)


def _live(i: int, tokens: tuple[int, ...], output: int = 4, answer: tuple[int, ...] = ()) -> Live:
    return Live(i, f"r{i}", len(tokens), output, [], 0.0, tokens=tokens, answer_tokens=answer)


def _run(rep: LlamaCppReplica, now: float = 0.0) -> float:
    """Steps until the replica is idle; the time then."""
    step = rep.plan(now)
    while step is not None:
        now = step.end
        rep.finish(now)
        step = rep.plan(now)
    return now


def test_one_slot_runs_one_request_at_a_time_and_the_next_reuses_what_the_slot_holds():
    rep = _replica()
    system = seq(0, 300)
    first = _live(0, (*system, 1000, 1001), output=4, answer=(2000, 2001, 2002))
    second = _live(1, (*system, 1000, 1001, 2000, 2001, 2002, 5))  # the next turn repeats the answer
    third = _live(2, seq(7000, 50))
    for r in (first, second, third):
        rep.enqueue(r)
    step = rep.plan(0.0)
    assert step is not None and [r for r, _ in step.chunks] == [first] and list(rep.waiting) == [second, third]
    _run(rep)
    assert first.hit_tokens == 0
    assert second.hit_tokens == 302 + 3  # the prompt and the generated tokens but the last
    assert third.hit_tokens == 0
    assert first.first_token_at < second.first_token_at < third.first_token_at
    assert rep.cache.entries[-1][:305] == second.tokens[:305]  # the second's sequence was saved when the third came
    assert rep.held_tokens(_live(3, (*system, 9))) == 300  # the host cache still holds the system prompt


def test_a_host_cache_entry_comes_back_when_the_slot_moved_on():
    rep = _replica()
    a, b = seq(0, 400), seq(10_000, 400)
    lives = [_live(i, tokens) for i, tokens in enumerate(((*a, 1), (*b, 1), (*a, 2)))]
    for live in lives:
        rep.enqueue(live)
        _run(rep)
    assert [r.hit_tokens for r in lives] == [0, 0, 400]
    assert rep.cache.restored == 1 and not rep.admitted
    assert rep.slots[0].held[:401] == (*a, 2)  # the third turn got a's prompt back from the host cache


def test_first_token_waits_for_the_response_time_outside_the_slot():
    rep = _replica()
    r = _live(0, seq(0, 100), output=1)
    rep.enqueue(r)
    end = _run(rep)
    assert r.first_token_at == pytest.approx(end + rep.response_s)


@pytest.mark.parametrize("factor", [0.6, 1.5])
def test_a_requests_time_factor_scales_its_steps_and_only_its_own(factor):
    """A calibration's run-to-run variation: the request's every step takes ``time_factor`` times the model's."""
    plain, varied = _replica(), _replica()
    base = _live(0, seq(0, 800), output=6)
    other = _live(0, seq(0, 800), output=6)
    other.time_factor = factor
    plain.enqueue(base)
    varied.enqueue(other)
    end_plain, end_varied = _run(plain), _run(varied)
    assert end_varied == pytest.approx(factor * end_plain)
    assert other.first_token_at - varied.response_s == pytest.approx(factor * (base.first_token_at - plain.response_s))
    after = _live(1, seq(5000, 300), output=2)  # the next request on the replica runs at the model's time
    again = _live(1, seq(5000, 300), output=2)
    plain.enqueue(after)
    varied.enqueue(again)
    assert _run(varied, end_varied) - end_varied == pytest.approx(_run(plain, end_plain) - end_plain)


def test_shared_cores_slow_concurrent_steps():
    alone = _replica()
    a = _live(0, seq(0, 1000), output=1)
    alone.enqueue(a)
    t_alone = _run(alone)
    cores = SharedCores(1.0)
    reps = [_replica(cores=cores), _replica(cores=cores)]
    lives = [_live(i, seq(i * 5000, 1000), output=1) for i in range(2)]
    for rep, live in zip(reps, lives, strict=True):
        rep.enqueue(live)
        rep.plan(0.0)
    assert {r.name for r in cores.take_moved()} == {"r0"}  # the first step's end moved when the second started
    assert all(rep.step is not None and rep.step.end == pytest.approx(2 * t_alone) for rep in reps)


def test_vllm_fleets_refuse_shared_cores():
    with pytest.raises(ValueError, match="cores"):
        FleetConfig(2, get_preset("cpu-llamacpp-ci"), cores=2.0)


def test_simulate_on_the_llamacpp_preset_reuses_a_shared_system_prompt():
    system = seq(0, 600)
    requests = [SimRequest(arrival=0.5 * i, prompt_tokens=603, output_tokens=4, keys=[],
                           tokens=(*system, 1000 + i, 1, 2), session=f"s{i}") for i in range(8)]
    result = simulate(Workload("t", 16, requests), "round_robin", FleetConfig(2, get_preset("llamacpp")))
    hits = [r.hit_tokens for r in result.requests]
    assert hits[:2] == [0, 0] and all(h == 600 for h in hits[2:])  # each replica computes the system prompt once
    assert all(r.first_token_at > r.arrival for r in result.requests)


def test_requests_known_only_by_their_keys_share_token_prefixes_where_they_share_keys():
    a = tokens_of_keys([11, 12, 13], 4, 14, idx=0)
    b = tokens_of_keys([11, 12, 99], 4, 12, idx=1)
    assert len(a) == 14 and len(b) == 12 and common_prefix(a, b) == 8
    assert common_prefix(tokens_of_keys([11], 4, 6, 0), tokens_of_keys([11], 4, 6, 1)) == 4  # tails are their own
    requests = [SimRequest(arrival=float(i), prompt_tokens=70, output_tokens=2, keys=[1, 2, 3, 4 + i])
                for i in range(3)]
    result = simulate(Workload("k", 16, requests), "round_robin", FleetConfig(1, get_preset("llamacpp")))
    assert [r.hit_tokens for r in result.requests] == [0, 48, 48]
