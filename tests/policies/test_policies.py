"""Policy behaviour: the mechanisms the anchors' issue trackers showed are needed."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.policies import ConfigError, Router, RouterConfig, build_policy, policy_names
from kvroute.policies.hashing import Rendezvous

BACKENDS = [f"r{i}" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def group_prompt(group: int, question: int, sys_len: int = 4000, q_len: int = 200) -> dict:
    rng = random.Random(group)
    system = "".join(rng.choice("abcdefghij ") for _ in range(sys_len))
    return {"model": "m", "messages": [{"role": "system", "content": f"group {group} " + system},
                                       {"role": "user", "content": f"q{question} " * (q_len // 4)}]}


def make(policy: str = "cache_aware", **knobs) -> tuple[Router, Clock]:
    clock = Clock()
    return Router(RouterConfig(default_policy=policy, default_knobs=knobs), clock=clock), clock


def test_registry_names_and_config_errors_name_the_key():
    assert {"round_robin", "least_load", "session_affinity", "prefix_hash", "cache_aware"} <= set(policy_names())
    with pytest.raises(ConfigError) as err:
        build_policy("cache_aware", {"queue_wieght": 1.0}, where="groups.llama")
    assert err.value.key == "groups.llama.queue_wieght"
    with pytest.raises(ConfigError) as err:
        build_policy("cache_aware", {"epsilon": -1})
    assert err.value.key == "policy.epsilon"
    with pytest.raises(ConfigError):
        build_policy("nope")


def test_round_robin_cycles():
    router, _ = make("round_robin")
    picks = [router.route(group_prompt(0, i), BACKENDS)[1].backend for i in range(8)]
    assert picks == BACKENDS * 2


def test_cache_aware_prefers_the_holder_of_the_longest_prefix():
    router, _clock = make()
    for g in range(4):  # one group per backend, completed
        req, dec = router.route(group_prompt(g, 0), BACKENDS)
        router.on_complete(req.request_id, cached_tokens=0)
    owners = {g: router.route(group_prompt(g, 99), BACKENDS)[1] for g in range(4)}
    for dec in owners.values():
        assert dec.reason == "prefix_match" and dec.matched_tokens >= 900
    assert len({d.backend for d in owners.values()}) == 4  # cold groups were spread, not stacked


def test_cold_requests_spread_by_least_recently_used():
    router, clock = make()
    picks = []
    for g in range(8):
        clock.t += 1
        req, dec = router.route(group_prompt(100 + g, 0), BACKENDS)
        router.on_complete(req.request_id, cached_tokens=0)
        picks.append(dec.backend)
        assert dec.reason == "cold"
    assert collections.Counter(picks) == {b: 2 for b in BACKENDS}


def test_short_prompts_skip_affinity_and_say_so():
    router, _ = make()
    dec = router.route({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, BACKENDS)[1]
    assert dec.skipped == "short_prompt" and dec.policy == "cache_aware"


def test_burst_of_siblings_is_recorded_at_once_and_co_located_while_cheap():
    # the hot-spot bound would spread a burst on an otherwise idle fleet (its floor is 50 ms of busy time):
    # this test is about the cost model, so the bound gets a 2 s floor here
    router, _ = make(busy_floor_s=2.0)
    # No completion in between: the first pick's blocks must already steer its sibling.
    first = router.route(group_prompt(7, 0, sys_len=40000), BACKENDS)[1]
    second = router.route(group_prompt(7, 1, sys_len=40000), BACKENDS)[1]
    assert first.backend is not None
    # The holder is busy prefilling 10k tokens, a cold backend would recompute 10k: a near tie that the
    # longer match wins (co-location), instead of scattering the new prefix over the fleet.
    assert second.backend == first.backend and second.matched_tokens > 9000


def test_hot_prefix_replicates_under_load_and_concentrates_again():
    router, clock = make(busy_floor_s=2.0)  # the cost model's replication, not the hot-spot bound
    # Demand outgrows one backend: many concurrent requests with one shared prefix.
    inflight = []
    for i in range(24):
        req, dec = router.route(group_prompt(1, i), BACKENDS)
        inflight.append(req.request_id)
    holders = {router.pending_backend(r) for r in inflight}
    assert len(holders) >= 3, holders  # spilled over several backends (hot-prefix replication)
    for rid in inflight:
        router.on_complete(rid, cached_tokens=0)
    # Demand falls: sequential requests all go to one stable holder again.
    later = []
    for i in range(12):
        clock.t += 1
        req, dec = router.route(group_prompt(1, 100 + i), BACKENDS)
        router.on_complete(req.request_id, cached_tokens=dec.matched_tokens)
        later.append(dec.backend)
    assert len(set(later)) == 1


def test_expected_wait_beats_saved_prefill():
    router, _ = make()
    req, dec = router.route(group_prompt(3, 0), BACKENDS)
    router.on_complete(req.request_id, cached_tokens=0)
    holder = dec.backend
    # The holder gets a huge queue of unrelated prefill work: the saving no longer pays for the wait.
    for i in range(3):
        router.state.load.start(f"blocker{i}", holder, 50_000, now=0)
    dec2 = router.route(group_prompt(3, 1), BACKENDS)[1]
    assert dec2.backend != holder and dec2.reason == "prefix_spill"


def test_session_affinity_sticks_and_moves_minimally():
    router, _ = make("session_affinity")
    sessions = [f"user-{i}" for i in range(200)]
    first = {s: router.route({**group_prompt(0, 0), "user": s}, BACKENDS)[1].backend for s in sessions}
    for rid in list(router.attempts.open):
        router.on_complete(rid)
    again = {s: router.route({**group_prompt(0, 1), "user": s}, BACKENDS)[1].backend for s in sessions}
    for rid in list(router.attempts.open):
        router.on_complete(rid)
    assert first == again
    grown = {s: router.route({**group_prompt(0, 2), "user": s}, [*BACKENDS, "r4"])[1].backend for s in sessions}
    moved = [s for s in sessions if grown[s] != first[s]]
    assert all(grown[s] == "r4" for s in moved)  # only keys won by the new backend move
    assert 0 < len(moved) < len(sessions) * 0.35
    no_key = router.route(group_prompt(0, 3), BACKENDS)[1]
    assert no_key.skipped == "no_session_key"


@given(st.lists(st.text(min_size=1, max_size=12), min_size=20, max_size=60, unique=True),
       st.integers(3, 9))
def test_rendezvous_removal_moves_only_the_removed_backends_keys(keys, n):
    hrw = Rendezvous()
    backends = [f"b{i}" for i in range(n)]
    before = {k: hrw.pick(k, backends) for k in keys}
    after = {k: hrw.pick(k, backends[1:]) for k in keys}
    for k in keys:
        if before[k] != "b0":
            assert after[k] == before[k]


def test_prefix_hash_routes_stable_start_and_skips_short():
    router, _ = make("prefix_hash")
    a = router.route(group_prompt(5, 1), BACKENDS)[1]
    b = router.route(group_prompt(5, 2), BACKENDS)[1]
    assert a.backend == b.backend and a.reason == "prefix_hash"
    short = router.route({"model": "m", "prompt": "tiny"}, BACKENDS)[1]
    assert short.skipped == "short_prompt"


@pytest.mark.slow
@given(st.integers(2, 12), st.integers(0, 2**31 - 1))
def test_cache_aware_hot_spot_bound_in_busy_seconds_under_cold_traffic(n, seed):
    """Cold work (moving it costs nothing; nobody holds it) never lands on a backend over (1+ε)·mean + floor
    busy seconds."""
    eps, floor = 0.25, 0.01
    router, clock = make(epsilon=eps, busy_floor_s=floor)
    backends = [f"r{i}" for i in range(n)]
    rng = random.Random(seed)
    live: list[str] = []
    for step in range(n * 12):
        clock.t += 0.01
        busy = {b: router.load.busy(b, clock.t) for b in backends}
        limit = (1 + eps) * sum(busy.values()) / n + floor
        req, dec = router.route(group_prompt(1000 + step, step, sys_len=rng.randrange(2000, 8000)), backends)
        assert dec.reason == "cold"
        assert busy[dec.backend] <= limit, (busy, limit, dec.backend)
        live.append(req.request_id)
        if len(live) > n * 4:  # steady state: a random older request completes
            router.on_complete(live.pop(rng.randrange(len(live) // 2)), cached_tokens=0)


def test_long_session_is_not_moved_by_many_short_requests_on_its_replica():
    """Load is work, not a request count: ten short requests in flight do not push a 25k-token session."""
    router, clock = make()
    session = group_prompt(9, 0, sys_len=100_000)
    req, home = router.route(session, BACKENDS)
    router.on_first_token(req.request_id)
    clock.t += 1.0
    router.on_complete(req.request_id, cached_tokens=0)
    for i in range(10):  # short, mostly cached requests keep the home replica's count high
        router.load.start(f"short{i}", home.backend, 50, clock.t, work_s=0.003)
    turn = dict(session, messages=[*session["messages"], {"role": "user", "content": "next " * 50}])
    again = router.route(turn, BACKENDS)[1]
    assert again.backend == home.backend and again.reason == "prefix_match"
    assert again.matched_tokens > 20_000


def test_near_tied_equal_holders_go_to_the_cheapest_not_always_the_same_replica():
    """Two replicas hold a prefix; the one the prefix's rendezvous order prefers has a small prefill queued
    (within the near-tie band): the next request goes to the other, idle holder. With both idle again, the
    prefix concentrates on the rendezvous-first holder."""
    router, clock = make()
    for i, only in enumerate((["r0"], ["r1"])):  # both replicas hold group 7's system prompt
        req, _ = router.route(group_prompt(7, i, q_len=8), only)
        router.on_complete(req.request_id, cached_tokens=0)
        clock.t += 100.0  # busy time decays away
    req, idle_pick = router.route(group_prompt(7, 10, q_len=8), ["r0", "r1"])
    router.on_complete(req.request_id, cached_tokens=idle_pick.matched_tokens)
    first = idle_pick.backend  # both idle: the rendezvous-first holder
    clock.t += 100.0
    router.route(group_prompt(7, 11, q_len=8), [first])  # in flight: only its short question to prefill
    # a long question: the band (5 % of its cost) covers the short prefill queued on ``first``
    _, d = router.route(group_prompt(7, 12, q_len=60000), ["r0", "r1"])
    assert d.reason == "prefix_match" and d.matched_tokens == idle_pick.matched_tokens
    assert d.backend != first, d


@pytest.mark.parametrize("replicas", [2, 4, 8])
@pytest.mark.parametrize("repeats", [110, 450, 1800], ids=["1.5k", "6k", "25k"])
def test_repeats_of_one_long_prompt_on_an_idle_fleet_stay_on_the_first_replica(replicas, repeats):
    """The same long prompt, one request at a time, to an idle fleet: every repeat goes to the replica that
    computed it first (a replica with nothing in flight is never over the hot-spot bound, whatever it served)."""
    router = Router()  # the real clock and the default config, as a user would start
    backends = [f"gpu-{i}" for i in range(replicas)]
    system = "You are a careful assistant for contract law questions. " * repeats
    picks = []
    for i in range(6):
        req, d = router.route({"model": "m", "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": f"q{i}"}]}, backends)
        picks.append(d)
        router.on_first_token(req.request_id)
        router.on_complete(req.request_id, cached_tokens=d.matched_tokens)
    assert picks[0].reason == "cold"
    assert {d.backend for d in picks} == {picks[0].backend}, [(d.backend, d.reason) for d in picks]
    for d in picks[1:]:
        assert d.reason == "prefix_match" and d.matched_tokens >= d.prompt_tokens - 64
        assert d.wasted_prefill_tokens == 0


def test_an_idle_holder_keeps_its_prefix_after_a_busy_minute():
    """Recent work does not make an idle replica hot: after serving a burst, once its requests are done the
    holder takes the next repeat of its prefix (busy seconds decay over a minute; the bound ignores them now)."""
    router, clock = make()
    first = None
    for i in range(30):  # a busy stretch: requests overlap on the holder
        req, d = router.route(group_prompt(2, i, sys_len=24000), BACKENDS)
        first = first or d.backend
        clock.t += 0.05
        router.on_complete(req.request_id, cached_tokens=d.matched_tokens)
    clock.t += 1.0
    others = [router.load.busy(b, clock.t) for b in BACKENDS if b != first]
    assert router.load.busy(first, clock.t) > 10 * 0.05 and max(others) == 0.0  # much recent work, none now
    d = router.route(group_prompt(2, 99, sys_len=24000), BACKENDS)[1]
    assert d.backend == first and d.reason == "prefix_match"


def test_a_new_session_weighs_the_work_already_at_the_holder_by_its_utilization():
    """A session's first request whose shared prefix one replica holds also pays that replica's recent busy
    seconds weighed by its utilization (its later turns will stay where it starts): it starts elsewhere once
    the holder is busy enough that this costs more than recomputing the prefix. A later turn of a known
    session, or a request with no session, stays. Lightly used, the holder keeps new sessions."""
    router, clock = make()

    def send(body: dict, backends: list[str], session: str | None = None):
        req, d = router.route({**body, "user": session} if session else body, backends)
        clock.t += 0.5
        router.on_first_token(req.request_id)
        router.on_complete(req.request_id, cached_tokens=d.matched_tokens)
        return d

    home = send(group_prompt(1, 0), BACKENDS, "s0").backend
    d = send(group_prompt(1, 1), BACKENDS, "s1")  # the holder is idle and its sessions bring little: it stays
    assert d.backend == home and d.reason == "prefix_match"
    for i in range(8):  # other sessions' long prompts kept the holder busy lately (nothing in flight now)
        for turn in range(3):
            send(group_prompt(100 + i, turn, sys_len=40000), [home], f"o{i}")
    assert router.load.utilization(router.load.busy(home, clock.t)) > 0.3
    d = send(group_prompt(1, 4), BACKENDS, "s2")  # a new session: starts where little work piled up
    assert d.backend != home and d.reason == "prefix_spill"
    assert send(group_prompt(1, 2), BACKENDS, "s0").backend == home  # a later turn stays home
    assert send(group_prompt(1, 3), BACKENDS).backend == home  # no session: nothing told apart


def _system_prompt() -> dict:
    """A 4,000-character system prompt (the same every call)."""
    rng = random.Random(3)
    return {"role": "system", "content": "".join(rng.choice("abcdefghij ") for _ in range(4000))}


def _answered_turn(router: Router, clock: Clock, body: dict, user: str):
    """Route ``body`` as ``user``'s turn, answer it 0.3 s later with what the pick matched cached."""
    req, d = router.route({**body, "user": user}, BACKENDS)
    clock.t += 0.3
    router.on_first_token(req.request_id)
    router.on_complete(req.request_id, cached_tokens=d.matched_tokens)
    return req, d


def test_a_new_session_starts_away_from_a_live_session_its_growth_would_evict():
    """A session's first request also pays for the live sessions' context its growth would push out where it
    starts: a conversation of the same system prompt grew to ~6k tokens on the holder; sessions of that prompt
    reach that size, and a 7k-token cache cannot hold two of them, so the new one starts on an idle replica.
    Where both fit, or once the other conversation is no longer live, it starts with its prefix."""
    system = _system_prompt()

    def conversation(name: str, turns: int, words: int) -> dict:
        messages = [system]
        for t in range(turns):
            messages.append({"role": "user", "content": " ".join(f"{name}{t}w{i}" for i in range(words))})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": f"answer {name} {t} " * 20})
        return {"model": "m", "messages": messages}

    for capacity, wait_s, moves in ((7_000, 0.0, True), (20_000, 0.0, False), (7_000, 3600.0, False)):
        router, clock = make()
        for b in BACKENDS:
            router.set_capacity(b, capacity)
        _, first = _answered_turn(router, clock, conversation("a", 1, 20), "A")
        later, d = _answered_turn(router, clock, conversation("a", 2, 1400), "A")  # the same conversation, grown
        assert d.backend == first.backend and 5_000 < later.prompt_tokens < capacity
        clock.t += wait_s
        new, d = _answered_turn(router, clock, conversation("b", 1, 20), "B")
        assert new.prompt_tokens + later.prompt_tokens - 960 < 7_000  # its first prompt alone would fit beside
        if moves:
            assert d.backend != first.backend and d.reason == "prefix_spill"
        else:
            assert d.backend == first.backend and d.reason == "prefix_match"


def test_a_fresh_router_that_saw_turns_come_back_at_once_starts_a_session_beside_a_finished_one():
    """A fresh router (no 8 returns seen yet) that watched a conversation's 7 turns each come back the moment the
    last was answered does not value that conversation's context as live 2 s after its last answer: the next
    session of its system prompt starts with the prefix. Right after the answer it still starts elsewhere (the
    context is worth all of it), and so it did 2 s later while the router waited for 8 returns before trusting
    the gap."""
    system = _system_prompt()

    def agent(name: str, turns: int) -> dict:
        """Its first request (``turns`` 0: the task alone), then the working context, growing a little a turn."""
        if turns == 0:
            return {"model": "m", "messages": [system, {"role": "user", "content": f"task {name}"}]}
        messages = [system, {"role": "user", "content": " ".join(f"{name}w{i}" for i in range(2400))}]
        for t in range(1, turns):
            messages += [{"role": "assistant", "content": f"answer {name} {t} " * 5},
                         {"role": "user", "content": f"next {name} {t}"}]
        return {"model": "m", "messages": messages}

    for returns, wait_s, moves in ((7, 2.0, False), (7, 0.0, True), (6, 2.0, False)):
        router, clock = make()
        for b in BACKENDS:
            router.set_capacity(b, 7_000)
        _, first = _answered_turn(router, clock, agent("a", 0), "A")
        for k in range(1, returns + 1):  # each turn leaves the moment the one before is answered
            later, d = _answered_turn(router, clock, agent("a", k), "A")
            assert d.backend == first.backend
        assert router.state.live.gap.samples == returns and 4_000 < later.prompt_tokens < 7_000
        clock.t += wait_s
        _, d = _answered_turn(router, clock, agent("b", 0), "B")
        assert (d.backend != first.backend, d.reason) == ((True, "prefix_spill") if moves else (False, "prefix_match"))


def test_a_working_holder_over_the_bound_spreads_a_cheap_prefix():
    """The bound still acts while the holder is working: with a long queue of work there, a prefix whose
    recompute is cheap spills (the hot prefix gains a second holder), with the wasted prefill reported."""
    router, _ = make()
    req, d0 = router.route(group_prompt(4, 0), BACKENDS)
    router.on_complete(req.request_id, cached_tokens=0)
    for i in range(6):  # the holder is kept working: unrelated requests in flight
        router.route(group_prompt(200 + i, 0, sys_len=8000), [d0.backend])
    d = router.route(group_prompt(4, 1), BACKENDS)[1]
    assert d.backend != d0.backend and d.reason == "prefix_spill"
    assert d.wasted_prefill_tokens > 900 and d.matched_tokens == 0


def test_wasted_prefill_is_reported_for_every_policy():
    """``Decision.wasted_prefill_tokens``: the longest other candidate's match minus the chosen backend's,
    from the index at decision time; cache_aware computes it itself, the Router fills it in for the others."""
    router, _ = make("round_robin")
    picks = []
    for i in range(4):
        req, d = router.route(group_prompt(6, i), BACKENDS[:2])
        router.on_complete(req.request_id, cached_tokens=0)
        picks.append(d)
    assert picks[0].wasted_prefill_tokens == 0  # nobody held anything
    assert picks[1].wasted_prefill_tokens > 900  # r1 prefills the system prompt r0 held
    assert picks[2].wasted_prefill_tokens == 0 and picks[3].wasted_prefill_tokens == 0  # both hold it now
    ca, _ = make()
    req, d = ca.route(group_prompt(6, 0), BACKENDS)
    ca.on_complete(req.request_id, cached_tokens=0)
    again = ca.route(group_prompt(6, 1), BACKENDS)[1]
    assert d.wasted_prefill_tokens == 0 and again.wasted_prefill_tokens == 0
    spilled = ca.route(group_prompt(6, 2), [b for b in BACKENDS if b != d.backend])[1]
    assert spilled.wasted_prefill_tokens == 0  # no candidate held it: nothing wasted among these
    assert "wasted_prefill_tokens" in again.as_dict()


def test_concurrent_first_turns_follow_a_prefix_still_being_computed():
    """A prefix sent to a replica is reserved there until its first token: a second request of the same system
    prompt, sent while the first is still prefilling, follows it instead of computing it again on an idle
    replica (``reserve_in_flight``); without the reservation it goes to the idle replica."""
    for reserve, together in ((True, True), (False, False)):
        router, _ = make(reserve_in_flight=reserve)
        first = router.route(group_prompt(7, 0, sys_len=4000), BACKENDS)[1]
        second = router.route(group_prompt(7, 1, sys_len=4000), BACKENDS)[1]
        assert (second.backend == first.backend) is together, reserve
        if together:
            assert second.reason == "prefix_match" and second.wasted_prefill_tokens == 0


def test_a_computed_prefix_is_not_reserved():
    """Once the holder's request has its first token the prefix is computed there, and an idle replica may take
    the next request by predicted TTFT as before (the reservation only covers work in flight)."""
    router, _clock = make()
    req, first = router.route(group_prompt(8, 0, sys_len=4000), BACKENDS)
    router.on_first_token(req.request_id)
    for i in range(6):  # the holder is kept working on other long prompts
        router.route(group_prompt(300 + i, 0, sys_len=8000), [first.backend])
    d = router.route(group_prompt(8, 1, sys_len=4000), BACKENDS)[1]
    assert d.backend != first.backend and d.reason == "prefix_spill"


def _session_turn(router, clock, session: str, turns: list[str], backends, answer_tokens: int = 40):
    """One turn of a chat whose earlier turns (and answers) are ``turns``; answered at once."""
    from kvroute.policies import RequestOutcome
    from kvroute.policies.lifecycle import SUCCESS

    messages = [{"role": "system", "content": "shared system prompt " * 200}]
    for i, t in enumerate(turns):
        messages.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i} " * 8})
    req, d = router.route({"model": "m", "messages": messages, "user": session}, backends)
    clock.t += 0.1
    router.on_first_token(req.request_id)
    router.finish(req, RequestOutcome(SUCCESS, d.backend, clock.t, cached_tokens=d.matched_tokens,
                                      output_tokens=answer_tokens, prompt_tokens=req.prompt_tokens))
    return d


@pytest.mark.parametrize("grain", [1, 16, None])
def test_a_sessions_next_turn_goes_where_its_tail_is_held(grain):
    """Two sessions of one system prompt on two replicas: the index's 64-token blocks see only the shared prompt
    on both, so their next turns tie; the session's home holds its tail (in the engine's own blocks: token by
    token on llama.cpp, ``block_size`` on vLLM), and each next turn goes home. Unknown engine blocks: no credit."""
    from kvroute.policies import PrefixIndex, PrefixIndexConfig

    clock = Clock()
    index = PrefixIndex(PrefixIndexConfig(block_tokens=64, engine_block_tokens=grain))
    router = Router(RouterConfig(), clock=clock, index=index)
    two = BACKENDS[:2]
    a = _session_turn(router, clock, "A", ["question a0 " * 4], two)
    b = _session_turn(router, clock, "B", ["question b0 " * 4], [x for x in two if x != a.backend])
    assert a.backend != b.backend
    # B's next turn first, A's second: with nothing to tell them apart the second turn of a tie rotates away
    b1 = _session_turn(router, clock, "B", ["question b0 " * 4, "question b1 " * 4], two)
    a1 = _session_turn(router, clock, "A", ["question a0 " * 4, "question a1 " * 4], two)
    whole = a1.prompt_tokens // 64 * 64 - 64  # the index's whole blocks of the shared part
    if grain is not None:
        assert (a1.backend, b1.backend) == (a.backend, b.backend)
        assert a1.matched_tokens > whole and b1.matched_tokens > whole  # credited past the index's blocks
    else:  # the tails are invisible: B's next turn went to A's replica, recomputing its own tail
        assert b1.backend == a.backend and b1.matched_tokens % 64 == 0


def test_the_router_learns_engine_tokens_and_converts_capacity_and_cached_tokens():
    """An engine that counts 2 tokens where the fingerprint estimates 1: its configured capacity holds half as many
    of the index's tokens, and the cached tokens it reports are halved before they confirm the index."""
    from kvroute.policies import PrefixIndex, PrefixIndexConfig, RequestOutcome
    from kvroute.policies.lifecycle import SUCCESS

    clock = Clock()
    index = PrefixIndex(PrefixIndexConfig(block_tokens=64))
    router = Router(RouterConfig(), clock=clock, index=index)
    router.set_capacity("r0", 64_000)
    assert index.capacity_blocks("r0") == 1000
    for i in range(30):
        req, _d = router.route(group_prompt(50 + i, 0), ["r0"])
        router.finish(req, RequestOutcome(SUCCESS, "r0", clock.t, cached_tokens=0,
                                          prompt_tokens=2 * req.prompt_tokens, output_tokens=1))
    assert router.token_ratio == pytest.approx(2.0, rel=0.01)
    assert index.capacity_blocks("r0") == pytest.approx(500, rel=0.03)
    router.learn_token_ratio(100_000, 1000)  # a report no tokenizer gives: ignored
    router.learn_token_ratio(80, 10)  # a prompt too short to tell (its chat template dominates): ignored
    assert router.token_ratio == pytest.approx(2.0, rel=0.01)


def test_a_prompt_index_weighs_each_answered_prompt_by_the_engines_count():
    """Through ``Router.finish``: the llama.cpp prompt index learns the engine-token ratio and each answered
    entry's size (prompt and answer as the engine counted them), converted into the index's tokens."""
    from kvroute.policies import RequestOutcome
    from kvroute.policies.lifecycle import SUCCESS
    from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

    clock = Clock()
    index = PromptIndex(PromptIndexConfig(block_tokens=64))
    router = Router(RouterConfig(), clock=clock, index=index)
    req, _d = router.route(group_prompt(7, 0), ["r0"])
    router.finish(req, RequestOutcome(SUCCESS, "r0", clock.t, cached_tokens=0,
                                      prompt_tokens=2 * req.prompt_tokens, output_tokens=10))
    state = index._backends["r0"]
    (eid,) = state.entries
    assert index.token_ratio == pytest.approx(router.token_ratio) and router.token_ratio > 1.0
    assert state.engine_size[eid] == 2 * req.prompt_tokens + 10
    assert index._size(state, eid) == pytest.approx((2 * req.prompt_tokens + 10) / router.token_ratio)


def test_a_new_prompt_goes_beside_no_live_conversation_on_whole_prompt_caches():
    """llama.cpp replicas, both idle: one holds a conversation answered a moment ago, the other only prompts of
    conversations that ended long ago but served more lately. A new app's first turn goes to the second: beside
    the live conversation its save could push that one out, whatever the index believes of their sizes (a new
    text's tokens per character is not known before its first answer)."""
    from kvroute.policies import RequestOutcome
    from kvroute.policies.lifecycle import SUCCESS
    from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

    clock = Clock()
    index = PromptIndex(PromptIndexConfig(cache_tokens=64_000, block_tokens=64, value_half_life_s=5.0))
    router = Router(RouterConfig(), clock=clock, index=index)
    for i in range(3):  # "b" served more, long ago: busier by the decayed busy seconds
        req, _ = router.route(group_prompt(10 + i, 0), ["b"])
        clock.t += 2.0
        router.finish(req, RequestOutcome(SUCCESS, "b", clock.t, cached_tokens=0))
    clock.t += 30.0
    live, _ = router.route(group_prompt(1, 0), ["a"])
    clock.t += 0.2
    router.finish(live, RequestOutcome(SUCCESS, "a", clock.t, cached_tokens=0))
    clock.t += 0.1
    assert router.load.busy("a", clock.t) < router.load.busy("b", clock.t)
    assert index.live_tokens("a", clock.t) > 0.9 * live.prompt_tokens
    assert index.live_tokens("b", clock.t) < 64  # under one block: counts nothing
    _, dec = router.route(group_prompt(2, 0), ["a", "b"])
    assert dec.reason == "cold" and dec.backend == "b", dec
