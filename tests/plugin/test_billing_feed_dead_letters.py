"""Every event the feed cannot store reaches the dead letters; a client's odd model name still makes a valid row."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.billing.deadletter import DeadLetter
from kvroute.billing.events import FIELD_LIMITS
from kvroute.plugin.adapter.billing_feed import BillingFeed
from kvroute.plugin.adapter.request_ids import RequestIds


class _NoRoute(Exception):
    status_code = 429

    def __init__(self) -> None:
        super().__init__("No deployments available for selected model")


class _Recorder:
    """The feed's boundary: ``record`` and the recorder's dead-letter file (a real one)."""

    def __init__(self, folder: Path) -> None:
        self.events: list = []
        self.dead_letter = DeadLetter(folder)
        self.noted = 0

    def record(self, event) -> None:
        self.events.append(event)

    def note_dead_letter(self) -> None:
        self.noted += 1


def _no_route(feed: BillingFeed, model: str) -> None:
    feed.logged_failure({"model": model, "litellm_params": {"metadata": {}}}, _NoRoute())


@pytest.mark.parametrize("model", ["llama\x00evil", "m" * 995, "ü" * 2000])
def test_a_no_route_row_for_an_odd_model_name_is_recorded(tmp_path: Path, model: str) -> None:
    rec = _Recorder(tmp_path)
    feed = BillingFeed(rec, RequestIds())
    _no_route(feed, model)
    _no_route(feed, model + "x")  # another request, another name: another row
    assert [e.status for e in rec.events] == ["no_route", "no_route"], rec.dead_letter.entries()
    for e in rec.events:
        assert "\x00" not in e.attempt_key and len(e.attempt_key) <= FIELD_LIMITS["attempt_key"]
    assert len({e.event_id for e in rec.events}) == 2
    assert rec.dead_letter.entries() == []


def test_an_event_that_cannot_be_built_is_dead_lettered_not_dropped(tmp_path: Path) -> None:
    """Whatever makes an event invalid (here: a provider usage that contradicts itself), the attempt lands in the
    dead letters for an operator instead of a debug log line."""
    rec = _Recorder(tmp_path)
    errors: list[str] = []
    feed = BillingFeed(rec, RequestIds(), on_error=errors.append)
    feed.success({"model": "llama", "litellm_params": {"metadata": {}}},
                 {"usage": {"prompt_tokens": -1, "completion_tokens": 3}}, None, None)
    assert rec.events == []
    entries = rec.dead_letter.entries()
    assert len(entries) == 1 and rec.noted == 1
    assert "usage.prompt_tokens" in entries[0].error and entries[0].source == "callback"


def test_an_unforeseen_failure_is_dead_lettered_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("a payload nothing foresaw")

    rec = _Recorder(tmp_path)
    errors: list[str] = []
    feed = BillingFeed(rec, RequestIds(), on_error=errors.append)
    monkeypatch.setattr(feed.events, "event_from_facts", broken)
    _no_route(feed, "llama")
    assert rec.events == [] and errors == ["billing"]
    assert [e.error for e in rec.dead_letter.entries()] == ["invalid event: a payload nothing foresaw"]
