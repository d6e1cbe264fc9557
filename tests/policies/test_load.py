"""Load tracker: charges at pick, releases once, weighs stale engine signals less."""

from __future__ import annotations

import pytest

from kvroute.policies import ExternalSignal, LoadTracker


def test_lifecycle_is_idempotent():
    load = LoadTracker()
    load.start("r1", "a", 1000, now=0)
    load.start("r2", "a", 500, now=0)
    assert load.inflight("a") == 2 and load.prefill_tokens("a") == 1500
    load.first_token("r1")
    load.first_token("r1")
    assert load.prefill_tokens("a") == 500 and load.inflight("a") == 2
    assert load.release("r1") == "a"
    assert load.release("r1") is None
    load.release("r2")
    assert load.inflight("a") == 0 and load.prefill_tokens("a") == 0


def test_move_follows_a_retry_and_expire_releases_lost_requests():
    load = LoadTracker()
    load.start("r1", "a", 100, now=0)
    load.move("r1", "b", now=1)
    assert load.inflight("a") == 0 and load.inflight("b") == 1 and load.prefill_tokens("b") == 100
    assert load.expire(now=1000, max_age_s=60) == 1
    assert load.inflight("b") == 0


def test_external_signals_age_out():
    load = LoadTracker(half_life_s=1.0, mean_prompt_tokens=100)
    load.observe("a", ExternalSignal(at=0, queue_depth=10, running=4, kv_usage=0.9))
    fresh = load.view("a", now=0)
    stale = load.view("a", now=5)
    assert fresh.queue_tokens == 1000 and fresh.running == 4 and abs(fresh.kv_usage - 0.9) < 1e-9
    assert stale.queue_tokens < 40 and stale.running == 0 and stale.kv_usage < 0.03


def test_router_side_load_is_not_double_counted_with_signal():
    load = LoadTracker(mean_prompt_tokens=100)
    load.start("r1", "a", 2000, now=0)
    load.observe("a", ExternalSignal(at=0, queue_depth=1))
    assert load.view("a", now=0).queue_tokens == 2000


def test_a_reading_behind_the_routers_own_burst_does_not_outlive_it():
    """llama.cpp read one request waiting (ours, behind ours on its one slot); both have since left, one of them
    before the reading reached the router: the replica is idle, whatever the reading's age. A departure before the
    reading does not count against it, and one of unknown time counts as before. (A tracker that was never given a
    reading counts nothing: its requests pay no bookkeeping.)"""
    load = LoadTracker(half_life_s=2.0, mean_prompt_tokens=800)
    load.observe("a", ExternalSignal(at=0.0, queue_depth=0))  # the scraper reads from the start
    load.start("first", "a", 800, now=0.0)
    load.start("second", "a", 800, now=0.1)
    load.first_token("first", 0.3)
    load.release("first", 0.45)  # after the reading at 0.4, before it arrives
    load.observe("a", ExternalSignal(at=0.4, queue_depth=1, running=1))
    load.first_token("second", 0.6)
    assert load.view("a", now=0.6).queue_tokens == 0  # "second" left the queue: the router's own count
    load.release("second", 0.9)
    assert load.view("a", now=1.0).queue_tokens == 0

    other = LoadTracker(half_life_s=2.0, mean_prompt_tokens=800)
    other.observe("b", ExternalSignal(at=0.0, queue_depth=0))
    other.start("done", "b", 800, now=0.0)
    other.release("done", 0.2)  # before the reading: the waiting request it shows is someone else's
    other.start("moved", "b", 800, now=0.3)
    other.move("moved", "c", now=0.35)  # no time: counts as before the reading
    other.observe("b", ExternalSignal(at=0.4, queue_depth=2))
    assert other.view("b", now=0.4).queue_tokens == pytest.approx(2 * other._mean_prompt)
    other.start("mine", "b", 100, now=0.5)
    other.release("mine", 0.7)  # one of the two waiting could start
    assert other.view("b", now=0.7).queue_tokens == pytest.approx(
        other.freshness(0.3) * other._mean_prompt)
    other.remove_backend("b")
    other.observe("b", ExternalSignal(at=1.0, queue_depth=1))
    assert other.view("b", now=1.0).queue_tokens == pytest.approx(other._mean_prompt)


def test_outstanding_work_drains_in_queue_order():
    """Only the first request not yet at first token is being computed, since it became the first, at the learned
    speed and up to its own work; the ones behind it wait whole; a new first starts its clock when it moves up."""
    load = LoadTracker()
    load.start("head", "a", 1000, now=0.0, work_s=1.0)
    load.start("next", "a", 1000, now=0.1, work_s=0.5)
    assert load.work_s("a", 0.0) == pytest.approx(1.5)
    assert load.work_s("a", 0.4) == pytest.approx(0.6 + 0.5)  # the head has 0.6 s left, the next waits whole
    assert load.work_s("a", 5.0) == pytest.approx(0.5)  # the head's own 1.0 s at most
    load.first_token("head", 2.0)
    assert load.work_s("a", 2.0) == pytest.approx(0.5)  # the next one's clock starts at the head's first token
    assert load.work_s("a", 2.2) == pytest.approx(0.3)
    load.release("next", 2.3)
    assert load.work_s("a", 2.3) == 0.0 and load.work_s("b", 2.3) == 0.0

    load.start("x", "b", 1000, now=10.0, work_s=1.0)
    load.start("y", "b", 1000, now=10.0, work_s=1.0)
    load.start("z", "b", 1000, now=13.0, work_s=1.0)
    load.release("y", 10.5)  # one behind the head leaves: the head's clock runs on
    assert load.work_s("b", 10.5) == pytest.approx(0.5 + 1.0)
    load.release("x")  # a failure without a time: the next one's clock starts when it was charged
    assert load.work_s("b", 13.5) == pytest.approx(0.5)


def test_outstanding_work_drains_at_the_learned_speed():
    load = LoadTracker()
    load.start("r", "a", 1000, now=0.0, work_s=0.1, ttft_s=0.1)
    load.first_token("r", 0.2)  # twice the prediction: prior seconds take two real seconds
    assert load.factor("a") == pytest.approx(2.0)
    load.start("s", "a", 1000, now=1.0, work_s=1.0)
    assert load.work_s("a", 1.4) == pytest.approx(0.8)
    assert load.work_s("a", 0.5) == pytest.approx(1.0)  # before its start: nothing done yet


def test_scoring_inputs_and_busy_many_equal_the_one_backend_getters():
    import random

    from kvroute.policies.load import BackendLoad, ExternalSignal, LoadTracker

    class Raised(LoadTracker):  # a subclass that adds to the view (as the shared tracker does) is asked
        def view(self, backend: str, now: float) -> BackendLoad:
            v = super().view(backend, now)
            return BackendLoad(v.inflight + 1, v.prefill_tokens, v.queue_tokens, v.running, v.kv_usage, v.last_pick)

    rng = random.Random(3)
    # the last tracker never sees an engine signal (the columnar path of scoring_inputs)
    for tracker, signals in ((LoadTracker(), True), (Raised(), True), (LoadTracker(), False)):
        backends = [f"b{i}" for i in range(12)]
        now = 0.0
        for i in range(400):
            now += rng.random() * 0.2
            b = rng.choice(backends)
            tracker.start(f"r{i}", b, rng.randrange(5000), now, work_s=rng.random(), ttft_s=rng.random())
            if rng.random() < 0.5:
                tracker.first_token(f"r{rng.randrange(i + 1)}", now)
            if rng.random() < 0.4:
                tracker.release(f"r{rng.randrange(i + 1)}", now + rng.random())
            if signals and rng.random() < 0.1:
                tracker.observe(rng.choice(backends), ExternalSignal(now - rng.random(), rng.choice([None, 3.0]),
                                                                     rng.choice([None, 7.0]), rng.random()))
            ask = rng.sample([*backends, "never-seen"], 6)
            states, picks = tracker.scoring_inputs(ask, now)
            for b2, st, lp in zip(ask, states, picks, strict=True):
                v = tracker.view(b2, now)
                want = (v.inflight, v.prefill_tokens, v.queue_tokens, v.running, v.kv_usage,
                        tracker.work_s(b2, now), tracker.queued(b2), tracker.decode_s(b2))
                assert st == want and [type(x) for x in st] == [type(x) for x in want]
                # the same state read a second later: drained, never grown, by at most a second of compute
                later = tracker.work_s(b2, now + 1.0)
                assert want[5] - 1.0 / tracker.factor(b2) - 1e-9 <= later <= want[5]
                assert lp == tracker.last_pick(b2)
            assert tracker.busy_many(ask, now) == [tracker.busy(b2, now) for b2 in ask]


def test_busy_decays_with_one_epoch_and_rebases_without_overflow() -> None:
    """Busy seconds kept against one epoch equal the per-backend decay (halving every ``busy_half_life_s``),
    across a rebase far past the epoch (days of uptime), without overflow."""
    import math

    from kvroute.policies.load import LoadTracker

    t = LoadTracker()
    h = t.busy_half_life_s
    t.add_busy("a", 2.0, 100.0)
    t.add_busy("b", 1.0, 130.0)
    t.add_busy("a", 1.0, 160.0)
    now = 220.0
    want_a = 2.0 * 0.5 ** ((now - 100.0) / h) + 1.0 * 0.5 ** ((now - 160.0) / h)
    want_b = 1.0 * 0.5 ** ((now - 130.0) / h)
    assert math.isclose(t.busy("a", now), want_a, rel_tol=1e-12)
    assert t.busy_many(["a", "b", "c"], now) == [t.busy("a", now), t.busy("b", now), 0.0]
    assert math.isclose(t.busy_many(["b"], now)[0], want_b, rel_tol=1e-12)
    later = 100.0 + 3 * 86400.0  # thousands of half-lives: the epoch moves, values stay finite
    t.add_busy("b", 4.0, later)
    assert math.isclose(t.busy("b", later), 4.0, rel_tol=1e-12)  # the old 1 s decayed to nothing
    assert math.isfinite(t.busy("a", later)) and t.busy("a", later) < 1e-300
    assert math.isclose(t.busy("b", later + h), 2.0, rel_tol=1e-12)


def test_mean_output_is_learned_fleet_wide_and_ignores_non_positive_counts():
    load = LoadTracker()
    assert load.output_tokens() == 0.0
    load.learn_output(1000)
    load.learn_output(0)
    load.learn_output(-5)
    assert load.output_tokens() == 1000.0
    load.learn_output(2000)
    assert load.output_tokens() == pytest.approx(1000 + LoadTracker.learn_rate * 1000)
