"""Server-owned request identity: ids kvroute wrote verify, client values of any type are dropped, attempts count."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from kvroute.plugin.adapter.attempt_events import Ended, How
from kvroute.plugin.adapter.request_ids import (
    ATTEMPT_KEY,
    CANCELLED,
    FAILED,
    REQUEST_KEY,
    SIG_KEY,
    SUCCESS,
    TICKET_KEY,
    Attempt,
    RequestIds,
    RequestState,
)
from kvroute.policies.attempts import Attempts, RoutedAttempt


@pytest.mark.parametrize("junk", ["x", {"a": 1}, [1, 2], 10**30, None, "", 3])
def test_client_values_are_dropped_and_replaced(junk: object) -> None:
    ids = RequestIds()
    meta = {ATTEMPT_KEY: junk, TICKET_KEY: junk, REQUEST_KEY: "evil", SIG_KEY: "0" * 24, "kvroute_trace": junk,
            "app": "kept"}
    _, attempt = ids.new_attempt(meta, "llama", None)
    ticket = attempt.ticket
    assert meta[REQUEST_KEY] != "evil" and len(meta[REQUEST_KEY]) == 32 and meta["app"] == "kept"
    assert (attempt.number, meta[ATTEMPT_KEY], meta[TICKET_KEY], ticket) == (1, 1, f"{meta[REQUEST_KEY]}:1", ticket)
    assert "kvroute_trace" not in meta and ids.ticket_of(meta) == ticket


def test_attempts_count_per_request_even_across_metadata_copies() -> None:
    ids = RequestIds()
    meta: dict = {}
    ids.new_attempt(meta, "llama", None)
    hop = dict(meta)  # LiteLLM copies the metadata dict for a fallback hop
    _, a2 = ids.new_attempt(hop, "hosted", None)
    t2 = a2.ticket
    assert a2.number == 2 and ids.request_of(hop) == ids.request_of(meta)
    other: dict = {}
    _, b1 = ids.new_attempt(other, "llama", None)
    assert b1.number == 1 and ids.request_of(other) != ids.request_of(meta)  # distinct requests never merge
    assert ids.attempt_of(t2) == (ids.requests[meta[REQUEST_KEY]], a2)


def test_a_forged_ticket_for_another_request_is_not_honoured() -> None:
    ids = RequestIds()
    victim: dict = {}
    victim_ticket = ids.new_attempt(victim, "llama", None)[1].ticket
    attacker: dict = {}
    ids.new_attempt(attacker, "llama", None)
    attacker[TICKET_KEY] = victim_ticket
    assert ids.ticket_of(attacker) is None
    assert ids.request_of({REQUEST_KEY: victim[REQUEST_KEY], SIG_KEY: "f" * 24}) is None


def test_another_process_cannot_vouch_for_an_id() -> None:
    meta: dict = {}
    RequestIds().new_attempt(meta, "llama", None)
    assert RequestIds().request_of(meta) is None


ROUTER = SimpleNamespace(attempts=Attempts())  # what an attempt's ``awaiting`` reads of its router


def _routed(ids: RequestIds) -> tuple[dict, Attempt]:
    """A request with one routed attempt awaiting its outcome (its router holds its record)."""
    meta: dict = {}
    _, attempt = ids.new_attempt(meta, "llama", "r0")
    attempt.router, attempt.routed = ROUTER, RoutedAttempt(attempt.ticket, "r0", 0.0)
    ROUTER.attempts.put(attempt.routed)
    assert attempt.awaiting
    return meta, attempt


def _end(ids: RequestIds, attempt: Attempt) -> None:
    """The attempt's outcome came: its router lets it go, and the request store hears the end."""
    ROUTER.attempts.pop(attempt.ticket)
    state = ids.attempt_of(attempt.ticket)
    ids.ended(Ended(How.SUCCESS, state, None, attempt.backend, ids.clock()))


def test_a_finished_request_is_forgotten_once_quiet_and_a_running_one_is_kept() -> None:
    t = [0.0]
    ids = RequestIds(quiet_s=60.0, stale_s=600.0, clock=lambda: t[0])
    done, done_attempt = _routed(ids)
    running, _ = _routed(ids)
    sent: dict = {}
    ids.new_attempt(sent, "hosted", "h0")[1].sent = True  # sent upstream, not routed, nothing booked yet
    _end(ids, done_attempt)
    t[0] = 59.0
    ids.release_quiet()
    assert ids.state(done) is not None  # a late event (the success log) still finds it
    t[0] = 61.0
    ids.release_quiet()
    assert ids.state(done) is None and ids.state(running) is not None and ids.state(sent) is not None
    t[0] = 601.0
    ids.release_quiet()
    assert ids.state(sent) is None and ids.state(running) is not None  # an outcome that never came: given up
    assert set(ids.requests) == {running["kvroute_request"]}


def test_the_store_stays_bounded_by_what_one_quiet_period_holds() -> None:
    t = [0.0]
    ids = RequestIds(quiet_s=60.0, clock=lambda: t[0])
    sizes = []
    for i in range(20_000):  # 10 requests a second for over half an hour, each answered within a second
        t[0] = i / 10
        _, attempt = _routed(ids)
        _end(ids, attempt)
        if i % 300 == 0:  # the callback's periodic expire (every 30 s)
            ids.release_quiet()
            sizes.append(len(ids.requests))
    assert max(sizes) <= 10 * (60 + 30) + 1


def test_the_store_is_in_order_of_last_change_so_a_full_store_evicts_the_least_recently_changed() -> None:
    t = [0.0]
    ids = RequestIds(max_requests=2, clock=lambda: t[0])
    old, old_attempt = _routed(ids)
    t[0] = 1.0
    newer, _ = _routed(ids)
    t[0] = 2.0
    _end(ids, old_attempt)  # the older request just changed: now the newest
    assert list(ids.requests) == [newer["kvroute_request"], old["kvroute_request"]]
    assert ids.requests[old["kvroute_request"]].changed == 2.0
    t[0] = 3.0
    _routed(ids)
    assert ids.state(old) is not None and ids.state(newer) is None


def test_a_request_ends_once_a_client_that_left_stays_its_end_and_an_answer_outranks_a_failure() -> None:
    state = RequestState("r")
    state.book_final(FAILED)
    state.book_final(SUCCESS)  # the answer came after all (a late pre-response record): it is the request's end
    state.book_final(FAILED)
    assert state.final == SUCCESS
    left = RequestState("l")
    left.book_final(CANCELLED)
    left.book_final(SUCCESS)  # its usage chunk, after the client went away
    left.book_final(FAILED)
    assert left.final == CANCELLED


def test_an_attempts_one_clock_reading_has_one_wall_time_for_the_ledger() -> None:
    now = [1000.0]
    ids = RequestIds(clock=lambda: now[0])
    _, attempt = ids.new_attempt({}, "llama", "r-0")
    attempt.started = ids.clock()
    booked = ids.wall(attempt.started)
    now[0] += 7.5  # booked later: the same reading, the same time
    assert ids.wall(attempt.started) == booked and booked.tzinfo is UTC
    assert (ids.wall(ids.clock()) - booked).total_seconds() == pytest.approx(7.5)
    assert abs((booked - datetime.now(UTC)).total_seconds()) < 60


def test_the_wall_offset_is_read_again_at_each_release(monkeypatch) -> None:
    ids = RequestIds(clock=lambda: 50.0)
    before = ids.wall(50.0)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # the host slept an hour; the monotonic clock did not
    assert ids.wall(50.0) == before  # one time per reading between releases
    ids.release_quiet()
    assert (ids.wall(50.0) - before).total_seconds() == pytest.approx(3600, abs=5)
