"""The llama.cpp prompt index keeps what llama.cpp's server keeps: whole prompts, its save / trim / restore rules."""

from __future__ import annotations

import pytest

from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

BT = 64
SYSTEM = list(range(100, 108))  # eight shared blocks
A0, B0 = [*SYSTEM, 1, 2], [*SYSTEM, 11, 12]  # two sessions of one system prompt
A1, B1 = [*A0, 3, 4], [*B0, 13]


def index(cache_blocks: int, slots: int = 1) -> PromptIndex:
    return PromptIndex(PromptIndexConfig(cache_tokens=cache_blocks * BT, slots=slots, block_tokens=BT))


def entries(ix: PromptIndex, backend: str = "x") -> list[tuple[int, ...]]:
    return list(ix._backends[backend].entries.values())


def test_a_prompt_that_continues_one_held_replaces_it_and_a_sibling_stays():
    ix = index(cache_blocks=10)
    ix.record("x", A0, 0.0)
    ix.record("x", B0, 0.0)  # the slot's A0 is saved; B0 shares only the system prompt: A0 stays cached
    assert ix.match(A1, ["x"], 0.0) == {"x": 10} and ix.match(B1, ["x"], 0.0) == {"x": 10}
    ix.record("x", A1, 0.0)  # A0 is contained in A1: obsolete
    assert entries(ix) == [tuple(B0), tuple(A1)]
    assert ix.match(["nothing"], ["x"], 0.0) == {}


def test_the_budget_drops_the_oldest_whole_prompt_but_always_keeps_one():
    ix = index(cache_blocks=10)
    ix.record("x", A0, 0.0)
    ix.record("x", B0, 0.0)
    other = list(range(500, 510))
    # the slot's B0 is saved beside A0: 20 blocks over a 10-block budget, the oldest (A0) goes as a whole; and
    # when the next request saves ``other`` in turn, B0 goes too: placing it here costs both
    assert ix.evictions("x", other, 0.0) == (len(A0) + len(B0)) * BT
    ix.record("x", other, 0.0)
    assert entries(ix) == [tuple(B0), tuple(other)]
    assert ix.match(A1, ["x"], 0.0) == {"x": len(SYSTEM)}  # A's own blocks went; B0 still holds the system prompt


def test_nothing_held_is_pushed_out_where_the_prompt_fits():
    ix = index(cache_blocks=100)
    ix.record("x", A0, 0.0)
    assert ix.evictions("x", B0, 0.0) == 0.0
    assert ix.evictions("y", B0, 0.0) == 0.0  # a replica it knows nothing of


def test_a_restored_prompt_leaves_the_cache_and_its_tail_is_lost():
    ix = index(cache_blocks=100)
    ix.record("x", A0, 0.0)
    ix.record("x", list(range(900, 905)), 0.0)  # the slot now holds an unrelated prompt; A0 is cached
    # A0 shares more with the new request than the slot does: restored into the slot, its own tail (2 blocks) lost
    assert ix.evictions("x", B0, 0.0) == 2 * BT
    ix.record("x", B0, 0.0)
    assert tuple(A0) not in entries(ix)


def test_evictions_weigh_each_lost_prompt_by_how_recently_it_was_used():
    ix = PromptIndex(PromptIndexConfig(cache_tokens=10 * BT, slots=1, block_tokens=BT, value_half_life_s=60.0))
    ix.record("x", A0, 0.0)
    ix.record("x", B0, 0.0)
    other = list(range(500, 510))
    fresh = ix.evictions("x", other, 0.0)
    assert fresh == (len(A0) + len(B0)) * BT  # both go (A0 when B0 is saved, B0 when ``other`` is)
    assert ix.evictions("x", other, 60.0) == pytest.approx(fresh / 2)  # unused for one half-life: worth half
    ix.confirm("x", B0, 10, 60.0)  # B0 answered again: used now, worth all of itself; A0 is still old
    assert ix.evictions("x", other, 60.0) == pytest.approx(len(A0) * BT / 2 + len(B0) * BT)


def test_slots_hold_prompts_beside_the_cache():
    ix = index(cache_blocks=20, slots=2)
    ix.record("x", A0, 0.0)
    ix.record("x", B0, 0.0)
    other = list(range(500, 510))
    # two slots: the new prompt takes the least recently given one (A0's), A0 is saved into the cache and B0
    # stays in its slot; with ``other`` saved later too, 20 blocks fit a 20-block cache: nothing is pushed out
    assert ix.evictions("x", other, 0.0) == 0.0
    ix.record("x", other, 0.0)
    assert entries(ix) == [tuple(A0), tuple(B0), tuple(other)]
    small = index(cache_blocks=10, slots=2)
    small.record("x", A0, 0.0)
    small.record("x", B0, 0.0)
    assert small.evictions("x", other, 0.0) == len(A0) * BT  # a 10-block cache: A0 goes when ``other`` is saved


def test_the_slot_prompt_saved_first_can_push_out_the_one_the_next_turn_needs():
    ix = index(cache_blocks=12)
    ix.record("x", A0, 0.0)
    other = list(range(500, 510))
    # ``other`` after A0: A0 is saved now (fits), and pushed out when ``other`` is saved for A1 next: A1 then finds
    # nothing to restore. Placing ``other`` here costs A0 in full
    assert ix.evictions("x", other, 0.0) == len(A0) * BT
    ix.record("x", other, 0.0)
    # for A1 itself: A0 goes (A1 contains it, no loss to price), and ``other`` goes when A1 is saved in turn
    assert ix.evictions("x", A1, 0.0) == len(other) * BT
    ix.record("x", A1, 0.0)
    assert entries(ix) == [tuple(other), tuple(A1)]
    ix.learn_size("x", other, 5 * BT)  # the engine counted it at half its blocks: that is what it weighs now
    # B0 next: A1's save pushes ``other`` out, B0's own save then A1 (less the system prompt B0 shares)
    assert ix.evictions("x", B0, 0.0) == pytest.approx(5 * BT + (len(A1) - len(SYSTEM)) * BT)


def test_forget_takes_a_failed_prompt_back_out():
    ix = index(cache_blocks=100)
    ix.record("x", A0, 0.0)
    ix.forget("x", A0)
    assert ix.match(A0, ["x"], 0.0) == {}
    ix.remove_backend("x")
    assert ix.backends() == []


def test_a_failed_request_gives_back_what_its_recording_pushed_out():
    """LiteLLM retries a failed attempt elsewhere; the replica never ran it, so it still holds what it held: the
    failed prompt's entry goes and the prompts its recording displaced are held again, oldest first as before."""
    ix = index(cache_blocks=12)
    ix.record("x", A0, 0.0)
    ix.record("x", B0, 1.0)  # A0 saved beside the slot's B0
    ix.confirm("x", B0, 0, 1.5)
    before = entries(ix)
    other = list(range(500, 510))
    ix.record("x", other, 2.0)  # would save B0 and push A0 out of the 12-block budget
    assert tuple(A0) not in entries(ix)
    ix.forget("x", other, 0)
    assert entries(ix) == before
    assert ix.match(A1, ["x"], 3.0) == {"x": len(A0)} and ix.match(B1, ["x"], 3.0) == {"x": len(B0)}
    # a failed continuation after a prefix match: its entry goes whole, the conversation it continued stays
    ix.record("x", B1, 4.0)
    ix.forget("x", B1, len(B0))
    assert entries(ix) == before
    assert ix.evictions("x", other, 5.0) < (len(A0) + len(B0)) * BT  # nothing pending is left at full worth


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        PromptIndexConfig(slots=0)
    with pytest.raises(ValueError):
        PromptIndexConfig(value_half_life_s=0.0)


def test_a_live_session_is_worth_more_than_a_finished_conversations_prompt_once_returns_are_learned():
    """Agent sessions beside a busy core: a new session's first turn shares the system prompt with session S
    on replica ``live`` and with nothing on ``idle``, which holds a bigger prompt of a conversation answered 20 s
    ago. With the configured 60 s half-life that stale prompt counts as more to lose, and the new session is put
    beside S, where the two evict each other every turn; as the fleet's turns are seen to come back within a
    second, the stale prompt is worth less, and next to nothing well before 8 returns."""
    def run(turns_seen: int) -> tuple[float, float, float]:
        ix = index(cache_blocks=30)
        t = 0.0
        turn = [*SYSTEM]
        for k in range(turns_seen + 1):  # session S on ``live``: a turn, its answer 0.2 s later, the next 0.3 s on
            turn = [*turn, 1000 + k, 2000 + k]
            ix.record("live", turn, t)
            ix.confirm("live", turn, len(turn) - 2, t + 0.2)
            t += 0.5
        stale = [*range(5000, 5026)]  # 26 blocks of a conversation that ended
        ix.record("idle", stale, t - 20.0)
        ix.confirm("idle", stale, 0, t - 19.8)
        new = [*SYSTEM, 7000, 7001]
        return ix.evictions("live", new, t), ix.evictions("idle", new, t), ix.value_half_life_s

    live, idle, half = run(turns_seen=0)  # no return seen: the configured half-life
    assert half == 60.0 and idle > live  # the stale prompt looks dearer: the new session would go beside S
    live, idle, half = run(turns_seen=2)  # two returns: trusted by 2 of 8, geometrically
    assert half == pytest.approx(60.0 ** 0.75 * 0.3 ** 0.25, rel=0.05) and idle > live
    live, idle, half = run(turns_seen=6)  # six: the stale prompt is already worth next to nothing
    assert live > idle and idle < 1.0
    live, idle, half = run(turns_seen=12)
    assert half == pytest.approx(0.3, abs=0.05)  # answered at +0.2 s, next turn at +0.5 s
    assert live > idle and idle < 1.0  # S's prompt is what would be lost; the stale one is worth ~nothing


def test_a_running_prompt_pushed_out_by_a_failed_one_comes_back_running():
    ix = index(cache_blocks=12)
    ix.record("x", A0, 0.0)  # running, never answered
    ix.record("x", B0, 0.0)  # running too; A0 saved into the cache
    other = list(range(500, 510))
    ix.record("x", other, 1.0)  # B0's save pushes A0 out of the 12-block budget
    assert tuple(A0) not in entries(ix)
    ix.forget("x", other)
    assert entries(ix) == [tuple(A0), tuple(B0)]
    assert ix._backends["x"].pending == {0, 1}  # still running: priced whole, not by the age of their sends
    assert ix.live_tokens("x", 50.0) == (len(A0) + len(B0)) * BT
