"""An attempt's life as events, through the real hooks: every attempt is picked and sent once and ends exactly once,
with how it ended; listeners run in order (the ledger before routing, so a kill between them loses nothing
billable), and one that raises is counted without stopping the others."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_attempt_stores_bounded import _Traffic

from kvroute.plugin.adapter.attempt_events import AttemptEvents, Ended, How
from kvroute.plugin.adapter.metrics import Metrics


class _Log:
    """Records every event of every attempt by ticket id."""

    def __init__(self, name: str = "log") -> None:
        self.name = name
        self.seen: list[tuple[str, str, str]] = []  # (event, ticket, detail)

    def picked(self, attempt, now: float) -> None:
        self.seen.append(("picked", attempt.ticket, attempt.backend))

    def sent(self, found, backend, data) -> None:
        self.seen.append(("sent", found[1].ticket, backend))

    def first_token(self, attempt) -> None:
        self.seen.append(("first_token", attempt.ticket, ""))

    def answered(self, attempt) -> None:
        self.seen.append(("answered", attempt.ticket, ""))

    def ended(self, e: Ended) -> None:
        self.seen.append(("ended", e.found[1].ticket if e.found else "?", e.how.value))


def test_every_attempt_is_picked_sent_and_ended_once_through_the_hooks(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path)
    log = _Log()
    traffic.cb.events.subscribe(log)
    kinds = ("success", "answered", "retried", "superseded", "cancelled")
    for kind in kinds * 4:
        traffic.serve(kind)
    ends = Counter(t for e, t, _ in log.seen if e == "ended")
    picks = [t for e, t, _ in log.seen if e == "picked"]
    assert len(picks) == len(set(picks)) == 4 * 7  # retried and superseded pick twice
    assert set(ends) == set(picks) and set(ends.values()) == {1}, ends
    sent = [t for e, t, _ in log.seen if e == "sent"]
    assert sorted(sent) == sorted(picks)
    hows = Counter(d for e, _, d in log.seen if e == "ended")
    assert hows == {"success": 4 * 4, "failed": 4, "superseded": 4, "cancelled": 4}
    assert Counter(e for e, _, _ in log.seen if e in ("first_token", "answered")) == {"answered": 4,
                                                                                       "first_token": 4}
    assert not traffic.cb.tickets  # every routed attempt let go


def test_an_attempt_ends_before_the_next_pick_of_its_request_begins(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path)
    log = _Log()
    traffic.cb.events.subscribe(log)
    traffic.serve("superseded")
    order = [(e, t) for e, t, _ in log.seen if e in ("picked", "ended")]
    first, second = order[0][1], order[-1][1]
    assert order == [("picked", first), ("ended", first), ("picked", second), ("ended", second)]


def test_listeners_run_in_order_and_a_failing_one_is_counted_not_fatal() -> None:
    errors: list[str] = []
    events = AttemptEvents(errors.append)
    calls: list[str] = []

    class Broken:
        name = "broken"

        def ended(self, e: Ended) -> None:
            calls.append("broken")
            raise RuntimeError("boom")

    class After:
        name = "after"

        def ended(self, e: Ended) -> None:
            calls.append("after")

    events.subscribe(Broken())
    events.subscribe(After())
    events.ended(Ended(How.EVICTED, None, None, None, 0.0))
    assert calls == ["broken", "after"] and errors == ["broken"]
    assert events.listeners("ended") == ["broken", "after"] and events.listeners("sent") == []


def test_the_emitter_flags_a_later_end_of_an_attempt_late_whatever_the_listeners_order() -> None:
    from types import SimpleNamespace

    events = AttemptEvents(lambda name: None)
    seen: list[tuple[str, bool, bool]] = []

    class Reader:
        def __init__(self, name: str) -> None:
            self.name = name

        def ended(self, e: Ended) -> None:
            seen.append((self.name, e.late, e.found[1].ended))

    events.subscribe(Reader("first"))
    events.subscribe(Reader("last"))
    attempt = SimpleNamespace(ended=False)
    events.ended(Ended(How.CANCELLED, (None, attempt), None, "b0", 1.0))
    assert attempt.ended
    events.ended(Ended(How.SUCCESS, (None, attempt), None, "b0", 2.0))  # LiteLLM's success log, after the cancel
    # every listener hears the first end as the first, and the later one as late, before or after the others
    assert seen == [("first", False, False), ("last", False, False), ("first", True, True), ("last", True, True)]


@pytest.mark.parametrize("billing", ["off", "sqlite"])
def test_the_ledger_listens_first(tmp_path: Path, billing: str) -> None:
    from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
    from kvroute.plugin.settings import KvrouteSettings

    db = "off" if billing == "off" else f"sqlite:///{tmp_path / 'ledger.db'}"
    cb = KvrouteCallback(KvrouteSettings(data_dir=tmp_path / "d", billing_db=db),
                         metrics=Metrics(CollectorRegistry()), mount=False)
    try:
        assert cb.events.listeners("ended") == ["billing", "routing", "metrics", "requests"]
        assert cb.events.listeners("sent") == ["billing", "routing"]
        assert (cb.billing is None) == (billing == "off")
    finally:
        import asyncio

        asyncio.run(cb.aclose())


def test_a_success_whose_figures_cannot_be_read_is_still_booked_and_releases_its_pick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.plugin.adapter import outcomes
    from kvroute.plugin.adapter.billing_feed import BillingFeed

    class Recorder:
        def __init__(self) -> None:
            self.events: list = []

        def record(self, event) -> None:
            self.events.append(event)

    traffic = _Traffic(tmp_path)
    rec = Recorder()
    traffic.cb.billing = BillingFeed(rec, traffic.cb.ids)

    def unreadable(*args, **kwargs):
        raise ValueError("a payload nothing foresaw")

    monkeypatch.setattr(outcomes, "answer_of", unreadable)
    traffic.serve("success")
    router = traffic.cb.routers["llama"]
    assert len(rec.events) == 1 and rec.events[0].status == "success"  # the ledger did not depend on the figures
    assert not traffic.cb.tickets and len(router.attempts) == 0  # the pick was released, not left to expire
    assert sum(router.load.inflight(b) for b in ("r-0", "r-1", "r-2")) == 0


def test_a_success_logged_after_the_client_left_is_no_completion_in_the_metrics(tmp_path: Path) -> None:
    """LiteLLM logs a stream's success after its client went away: the metrics counted the cancel, not a success."""
    import asyncio

    traffic = _Traffic(tmp_path)
    outcomes = traffic.cb.metrics.outcomes
    call = traffic.pick({})
    asyncio.run(traffic.leave(call))
    traffic.succeed(call)  # the late success log
    traffic.serve("success")  # and an ordinary one
    counted = Counter()
    for metric in outcomes.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counted[sample.labels["outcome"]] += sample.value
    assert counted == {"cancelled": 1, "success": 1}, counted
