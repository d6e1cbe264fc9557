"""Router façade: never raises, falls back to least-load with the reason, keeps lifecycle consistent."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.policies import Decision, Policy, PrefixIndexConfig, Router, RouterConfig, policy_names

LONG = {"model": "m", "messages": [{"role": "system", "content": "s" * 8000}, {"role": "user", "content": "q"}]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=20,
)


@given(kwargs=st.dictionaries(st.sampled_from(["model", "messages", "prompt", "input", "tools", "user",
                                               "metadata", "functions", "instructions", "cache_salt"]),
                              json_values, max_size=6),
       n=st.integers(0, 5), policy=st.sampled_from(["round_robin", "least_load", "session_affinity",
                                                     "prefix_hash", "cache_aware"]))
def test_pick_never_raises_on_any_input(kwargs, n, policy):
    router = Router(RouterConfig(default_policy=policy))
    backends = [f"b{i}" for i in range(n)]
    req, dec = router.route(kwargs, backends)
    assert isinstance(dec, Decision)
    if n == 0:
        assert dec.backend is None and dec.reason == "no_candidates"
    else:
        assert dec.backend in backends
    router.on_complete(req.request_id, cached_tokens=7)
    assert all(router.load.inflight(b) == 0 for b in backends)


class Exploding(Policy):
    name = "exploding"

    def select(self, request, candidates, state, now):
        raise RuntimeError("boom")


class Rogue(Policy):
    name = "rogue"

    def select(self, request, candidates, state, now):
        return Decision("not-a-candidate", self.name, "x")


def test_policy_errors_fall_back_to_least_load_and_are_recorded():
    router = Router()
    router.set_policy_object("m", Exploding())
    router.state.load.start("busy", "a", 100, now=0)
    dec = router.route(LONG, ["a", "b"])[1]
    assert dec.backend == "b" and dec.reason == "fallback" and "boom" in (dec.fallback or "")
    router.set_policy_object("m", Rogue())
    dec = router.route(LONG, ["a", "b"])[1]
    assert dec.backend in {"a", "b"} and dec.reason == "fallback"
    assert router.errors == 2


def test_single_candidate_goes_through_the_policy_and_reports_the_match():
    router = Router()
    req, _ = router.route(LONG, ["a"])
    router.on_complete(req.request_id, cached_tokens=0)
    dec = router.route(LONG, ["a"])[1]
    assert dec.backend == "a" and dec.reason == "prefix_match" and dec.matched_tokens > 1500


def test_failure_before_prefill_takes_the_blocks_back():
    router = Router()
    req, dec = router.route(LONG, ["a", "b"])
    router.on_failure(req.request_id)
    assert router.load.inflight(dec.backend) == 0
    assert router.index.match(req.keys, ["a", "b"], now=router.clock()) == {}


def test_retry_on_another_backend_moves_load_and_blocks():
    router = Router()
    req, dec = router.route(LONG, ["a", "b"])
    other = "b" if dec.backend == "a" else "a"
    router.on_attempt(req.request_id, other)
    assert router.load.inflight(other) == 1 and router.load.inflight(dec.backend) == 0
    router.on_complete(req.request_id, cached_tokens=0)
    assert router.index.match(req.keys, [other], now=router.clock())[other] == len(req.keys)
    assert router.index.match(req.keys, [dec.backend], now=router.clock()) == {}


def test_cancel_releases_and_expire_cleans_lost_callbacks():
    t = [0.0]
    router = Router(RouterConfig(max_request_age_s=10), clock=lambda: t[0])
    req, dec = router.route(LONG, ["a", "b"])
    router.on_cancel(req.request_id)
    assert router.load.inflight(dec.backend) == 0
    router.route(LONG, ["a", "b"])
    t[0] = 100
    assert router.expire() == 1
    assert router.load.total_inflight(["a", "b"]) == 0 and not router.attempts.open


def test_remove_backend_purges_state_and_groups_have_own_policies():
    router = Router()
    router.set_policy("batch", "least_load")
    assert router.policy_for("batch").name == "least_load"
    assert router.policy_for("other").name == "cache_aware"
    _req, dec = router.route(LONG, ["a", "b"])
    router.remove_backend(dec.backend)
    assert router.index.blocks(dec.backend) == 0 and router.load.inflight(dec.backend) == 0
    assert set(policy_names()) >= {"cache_aware"}


def test_an_emptied_engine_holds_nothing_and_keeps_its_capacity_and_load():
    """A restarted replica: what the index believed it held is gone (the next request of that prompt is cold
    there), its capacity and in-flight load stay, and the other replicas keep theirs."""
    from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

    for index in (None, PromptIndex(PromptIndexConfig(cache_tokens=4096, block_tokens=64))):
        router = Router(RouterConfig(), index=index)
        router.set_capacity("a", 3000)
        router.set_capacity("b", 3000)
        req, dec = router.route(LONG, ["a", "b"])
        router.on_complete(req.request_id, cached_tokens=0, backend=dec.backend)
        other = "b" if dec.backend == "a" else "a"
        req2, _ = router.route(LONG, [other])
        router.on_complete(req2.request_id, cached_tokens=0, backend=other)
        busy, _ = router.route(LONG, [dec.backend])  # in flight there while it restarts
        capacity = router.index.capacity_blocks(dec.backend)
        router.engine_emptied(dec.backend)  # heard on the scraper's thread: applied by the next pick
        now = router.clock()
        assert router.index.match(req.keys, [dec.backend, other], now=now) == {dec.backend: len(req.keys),
                                                                                 other: len(req.keys)}
        router.pick(router.fingerprint(LONG), [dec.backend, other], record=False)
        assert router.index.match(req.keys, [dec.backend, other], now=now) == {other: len(req.keys)}
        assert router.index.capacity_blocks(dec.backend) == capacity
        assert router.load.inflight(dec.backend) == 1
        router.on_complete(busy.request_id, cached_tokens=0, backend=dec.backend)
        assert router.load.inflight(dec.backend) == 0


def test_a_restart_seen_a_scrape_late_keeps_what_the_new_engine_was_given_since():
    """llama.cpp restarted between two scrapes; before the scrape that shows it, the router already sent the new
    engine a conversation. The prompt index drops what the old engine held and keeps that conversation."""
    from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

    now = [0.0]
    index = PromptIndex(PromptIndexConfig(cache_tokens=8192, block_tokens=64))
    router = Router(RouterConfig(), index=index, clock=lambda: now[0])
    old, _ = router.route(LONG, ["a"])
    router.on_complete(old.request_id, cached_tokens=0, backend="a")
    now[0] = 5.0  # the old engine's last reading; it restarts after this
    newer = {"model": "m", "messages": [{"role": "user", "content": "another conversation " * 300}]}
    now[0] = 5.5
    new, _ = router.route(newer, ["a"])
    router.on_complete(new.request_id, cached_tokens=0, backend="a")
    now[0] = 6.0
    router.engine_emptied("a", before=5.0)
    router.pick(router.fingerprint(newer), ["a"], record=False)
    assert router.index.match(old.keys, ["a"], now=6.0) == {}
    assert router.index.match(new.keys, ["a"], now=6.0) == {"a": len(new.keys)}


def test_a_capacity_an_engine_reports_is_applied_by_the_next_pick_not_on_the_scrapers_thread():
    """The scraper hears a smaller KV capacity: the index (which only the router's thread changes) shrinks and
    evicts at the next pick, not while another thread may be matching in it; a backend removed meanwhile stays
    gone."""
    router = Router()
    router.set_capacity("a", 4096)
    router.set_capacity("b", 4096)
    req, _ = router.route(LONG, ["a"])
    router.on_complete(req.request_id, cached_tokens=0, backend="a")
    held = router.index.blocks("a")
    assert held > 1
    router.capacity_heard("a", 16)  # room for one block
    router.capacity_heard("b", 16)
    router.remove_backend("b")
    assert router.index.blocks("a") == held  # heard, not yet applied
    router.pick(router.fingerprint(LONG), ["a"], record=False)
    assert router.index.blocks("a") <= 1 < held
    assert router.index.capacity_blocks("b") == router.index.capacity_blocks("never-seen")  # the default: unset


def test_siblings_racing_a_prefill_do_not_shrink_the_learned_capacity():
    router = Router(RouterConfig(index=PrefixIndexConfig(learn_capacity=True)))
    first, d1 = router.route(LONG, ["a"])  # one backend: this is about learning, not picking
    sibling, d2 = router.route(LONG, ["a"])
    assert d2.backend == d1.backend and d2.matched_blocks > 0
    cap = router.index.capacity_blocks(d1.backend)
    # The sibling was batched with the first request's prefill: the engine reports no cached tokens.
    router.on_complete(sibling.request_id, cached_tokens=0)
    router.on_complete(first.request_id, cached_tokens=0)
    assert router.index.capacity_blocks(d1.backend) == cap
    # A prediction built on a completed prefill that the engine contradicts is a real eviction.
    third, d3 = router.route(LONG, ["a"])
    router.on_complete(third.request_id, cached_tokens=0)
    assert router.index.capacity_blocks(d3.backend) < cap
    assert not router._provisional


def test_first_token_settles_provisional_blocks():
    router = Router()
    first, _ = router.route(LONG, ["a", "b"])
    router.on_first_token(first.request_id)
    sibling, d2 = router.route(LONG, ["a", "b"])
    assert router.attempts.open[sibling.request_id].confirmed_blocks == d2.matched_blocks > 0
    router.on_failure(first.request_id, before_prefill=False)
    router.on_cancel(sibling.request_id)
    assert not router._provisional and not router.attempts.open


def test_a_repicked_request_id_becomes_the_newest_pending_and_the_oldest_is_released_first() -> None:
    router = Router(RouterConfig(default_policy="least_load", max_pending=2))
    requests = {rid: router.fingerprint({"model": "m", "messages": [{"role": "user", "content": rid * 300}]},
                                        request_id=rid) for rid in ("a", "b", "c")}
    router.pick(requests["a"], ["x", "y"])
    router.pick(requests["b"], ["x", "y"])
    router.pick(requests["a"], ["x", "y"])  # again: now newer than b
    router.pick(requests["c"], ["x", "y"])  # over max_pending: b (the oldest) is released, not a
    assert router.pending_backend("b") is None
    assert router.pending_backend("a") is not None and router.pending_backend("c") is not None
    assert router.load.backend_of("b") is None and router.load.backend_of("a") is not None
    assert router.errors == 0


def test_an_answered_request_releases_its_load_and_still_confirms_the_index_later() -> None:
    """``on_answered`` (the answer is back, its outcome reported later): the load goes at once, the pending pick
    survives ``expire`` until its outcome confirms the index (or it is older than ``max_request_age_s``)."""
    t = [0.0]
    router = Router(RouterConfig(max_request_age_s=60.0), clock=lambda: t[0])
    msgs = {"model": "m", "messages": [{"role": "user", "content": "word " * 2000}]}
    req, d = router.route(msgs, ["a", "b"])
    assert router.load.inflight(d.backend) == 1
    router.on_answered(req.request_id)
    assert router.load.inflight(d.backend) == 0 and router.load.work_s(d.backend, t[0]) == 0.0
    t[0] = 10.0
    router.expire()
    assert router.pending_backend(req.request_id) == d.backend
    router.on_complete(req.request_id, cached_tokens=0)
    assert router.pending_backend(req.request_id) is None
    req2, _ = router.route(msgs, ["a", "b"])
    router.on_answered(req2.request_id)
    t[0] = 100.0
    router.expire()  # its outcome never came: dropped once older than max_request_age_s
    assert router.pending_backend(req2.request_id) is None


def test_a_failed_follow_up_on_a_prompt_index_leaves_the_conversation_held_and_nothing_pending():
    """llama.cpp keeps whole prompts: a follow-up's attempt that failed (and LiteLLM retried elsewhere) was never
    run by its replica, so the replica still holds the conversation so far, and no never-answered prompt there is
    priced as live (it repelled every later first turn from that replica for a minute)."""
    from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig

    index = PromptIndex(PromptIndexConfig(cache_tokens=4096, block_tokens=64))
    router = Router(RouterConfig(), index=index)
    first = {"model": "m", "messages": [{"role": "system", "content": "s " * 3000}, {"role": "user", "content": "q1"}]}
    req, dec = router.route(first, ["a", "b"])
    router.on_complete(req.request_id, cached_tokens=0, backend=dec.backend)
    follow = {"model": "m", "messages": [*first["messages"], {"role": "assistant", "content": "a1 " * 40},
                                         {"role": "user", "content": "q2 " * 40}]}
    req2, dec2 = router.route(follow, ["a", "b"])
    assert dec2.backend == dec.backend and dec2.reason == "prefix_match"
    other = "b" if dec.backend == "a" else "a"
    router.on_attempt(req2.request_id, other)  # LiteLLM's retry went elsewhere after the holder's attempt failed
    router.on_failure(req2.request_id, before_prefill=True)
    now = router.clock()
    held = router.index.match(req.keys, [dec.backend], now=now)
    assert held == {dec.backend: len(req.keys)}  # the first turn's prompt is held where it was computed
    state = index._backends[dec.backend]
    assert not state.pending and list(state.entries.values()) == [tuple(req.keys)]
