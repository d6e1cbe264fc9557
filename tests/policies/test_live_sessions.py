"""``LiveSessions``: where each session's context lives, what a backend holds of live sessions, how sessions grow."""

from __future__ import annotations

import pytest

from kvroute.policies.return_gap import SAMPLES
from kvroute.policies.sessions import LiveSessions


def test_a_running_turn_counts_whole_and_an_ended_one_halves_every_half_life():
    live = LiveSessions(half_life_s=10.0)
    live.sent("a", 7, "r0", 1000, now=0.0)
    assert live.at_risk("r0", 0, 5.0) == 1000.0  # running: all of it
    assert live.at_risk("r0", 400, 5.0) == 600.0  # beyond the prefix a new prompt shares with it
    assert live.at_risk("r1", 0, 5.0) == 0.0
    live.ended("a", "r0", 5.0)
    live.answered("a", "r0", 1200)  # its context there is prompt and answer
    assert live.at_risk("r0", 0, 15.0) == pytest.approx(600.0)
    assert live.at_risk("r0", 0, 200.0) == 0.0  # worth under 1 %: forgotten
    live.sent("a", 7, "r1", 1500, now=201.0)  # forgotten: its next turn is like a new session's
    assert live.growth(7) == 0.0


def test_a_session_lives_where_its_last_turn_went_and_its_later_turns_teach_the_growth():
    live = LiveSessions()
    live.sent("a", 7, "r0", 1000, now=0.0)
    assert live.growth(7) == 0.0  # no later turn seen yet
    live.ended("a", "r0", 1.0)
    live.answered("a", "r0", 1100)
    live.sent("a", 7, "r1", 1600, now=1.5)  # moved: r0 no longer holds it as live
    assert live.at_risk("r0", 0, 1.5) == 0.0 and live.at_risk("r1", 0, 1.5) == 1600.0
    assert live.growth(7) == 1600.0 and live.growth(8) == 0.0
    live.ended("a", "r0", 2.0)  # a stale end elsewhere (a lost hedge) changes nothing
    live.answered("a", "r0", 5000)
    assert live.at_risk("r1", 0, 2.0) == 1600.0
    live.ended("a", "r1", 2.0)
    live.sent("a", 7, "r1", 2200, now=2.0)
    assert live.growth(7) == pytest.approx(1600.0 + 0.25 * 600.0)


def test_a_retry_or_hedge_of_the_same_prompt_is_no_later_turn():
    live = LiveSessions()
    live.sent("a", 7, "r0", 1000, now=0.0)
    live.ended("a", "r0", 1.0)  # failed: its size stays the prompt's
    live.sent("a", 7, "r1", 1000, now=1.5)  # LiteLLM's retry elsewhere
    live.sent("a", 7, "r2", 1000, now=1.6)  # and a hedge of it
    assert live.growth(7) == 0.0 and live.gap.samples == 0
    assert live.at_risk("r2", 0, 1.6) == 1000.0 and live.at_risk("r1", 0, 1.6) == 0.0  # it lives where it went last


def test_the_half_life_becomes_the_learned_gap_to_a_sessions_next_turn():
    live = LiveSessions(half_life_s=60.0)
    for i in range(SAMPLES):
        key = f"s{i}"
        live.sent(key, 1, "r0", 500, now=10.0 * i)
        live.ended(key, "r0", 10.0 * i + 1.0)
        live.sent(key, 1, "r0", 600, now=10.0 * i + 3.0)  # came back 2 s after its answer
        live.ended(key, "r0", 10.0 * i + 4.0)
    assert live.gap.half_life_s == pytest.approx(2.0)
    live.sent("x", 1, "r1", 1000, now=100.0)
    live.ended("x", "r1", 100.0)
    assert live.at_risk("r1", 0, 102.0) == pytest.approx(500.0)


def test_bounds_forget_and_bad_input():
    live = LiveSessions(capacity=2)
    for i, b in enumerate(("r0", "r1", "r2")):
        live.sent(f"s{i}", 1, b, 100, now=0.0)
    assert live.at_risk("r0", 0, 0.0) == 0.0 and live.at_risk("r2", 0, 0.0) == 100.0  # the oldest went
    live.forget("r2")
    assert live.at_risk("r2", 0, 0.0) == 0.0
    live.sent(None, 1, "r0", 100, now=0.0)  # no session: nothing kept
    assert live.at_risk("r0", 0, 0.0) == 0.0
    assert LiveSessions(capacity=0).at_risk("r0", 0, 0.0) == 0.0
    with pytest.raises(ValueError):
        LiveSessions(half_life_s=0.0)


def test_the_router_keeps_it_a_session_lives_where_its_turn_went_until_the_backend_goes():
    from kvroute.policies import Router, RouterConfig

    t = [0.0]
    router = Router(RouterConfig(), clock=lambda: t[0])
    body = {"model": "m", "user": "s1", "messages": [{"role": "system", "content": "tools " * 800},
                                                     {"role": "user", "content": "hello"}]}
    req, d = router.route(body, ["r0", "r1"])
    live = router.state.live
    assert live.at_risk(d.backend, 0, 0.0) == req.prompt_tokens  # running there
    assert live.at_risk(d.backend, 0, 61.0) < req.prompt_tokens  # running past 60 s: its end was lost, it decays
    t[0] = 30.0
    assert live.at_risk(d.backend, 0, 30.0) == req.prompt_tokens  # still running: no end heard
    router.on_cancel(req.request_id)  # ended (cut): it decays from now
    assert live.at_risk(d.backend, 0, 90.0) == pytest.approx(req.prompt_tokens / 2)
    router.route({**body, "user": None}, ["r0", "r1"])  # no session key: not a session
    assert live.at_risk("r0", 0, 90.0) + live.at_risk("r1", 0, 90.0) == pytest.approx(req.prompt_tokens / 2)
    router.remove_backend(d.backend)
    assert live.at_risk(d.backend, 0, 90.0) == 0.0


def test_the_return_gap_ignores_a_negative_gap_and_needs_a_positive_cap():
    from kvroute.policies.return_gap import ReturnGap

    gap = ReturnGap(30.0)
    for _ in range(SAMPLES):
        gap.note(-1.0)  # a clock step back: not a sample
    assert gap.samples == 0 and gap.half_life_s == 30.0
    for _ in range(SAMPLES):
        gap.note(0.0)
    assert gap.half_life_s == 0.05  # never below the floor
    assert gap.worth(100.0, True, 1.0) == 0.5**100  # running past the cap: its end was lost
    assert gap.worth(-5.0, True, 1.0) == 1.0
    with pytest.raises(ValueError):
        ReturnGap(0.0)


def test_an_answer_through_the_router_sizes_the_session_by_prompt_and_answer():
    from kvroute.policies import Router, RouterConfig
    from kvroute.policies.lifecycle import SUCCESS, RequestOutcome

    t = [0.0]
    router = Router(RouterConfig(), clock=lambda: t[0])
    body = {"model": "m", "user": "s1", "messages": [{"role": "user", "content": "hello " * 600}]}
    req, d = router.route(body, ["r0", "r1"])
    router.finish(req, RequestOutcome(SUCCESS, d.backend, 0.0, prompt_tokens=req.prompt_tokens, output_tokens=300))
    assert router.state.live.at_risk(d.backend, 0, 0.0) == pytest.approx(req.prompt_tokens + 300, abs=2)


def test_a_fresh_router_trusts_the_gaps_it_learned_by_how_many_came_back():
    from kvroute.policies.return_gap import ReturnGap

    gap = ReturnGap(60.0)
    assert gap.half_life_s == 60.0  # nothing came back yet: the cap
    halves = []
    for _ in range(SAMPLES):
        gap.note(0.03)  # agents' next turns, 30 ms after each answer
        halves.append(gap.half_life_s)
    assert halves == sorted(halves, reverse=True) and halves[-1] == pytest.approx(0.05)  # the floor, trusted wholly
    assert halves[0] == pytest.approx(60.0 ** (1 - 1 / SAMPLES) * 0.05 ** (1 / SAMPLES))
    assert halves[SAMPLES // 2 - 1] == pytest.approx((60.0 * 0.05) ** 0.5)  # half trusted: the geometric mean
    # seven such turns in, an agent that finished 0.85 s ago is worth next to nothing, not what a live one is
    early = ReturnGap(60.0)
    for _ in range(SAMPLES - 1):
        early.note(0.03)
    assert early.worth(0.85, False, early.half_life_s) < 0.01  # below what LiveSessions forgets
