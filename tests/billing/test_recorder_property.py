"""Property: every event the request path can build from a LiteLLM payload is accepted by replay, and the recorder
stores or dead-letters each one without ever blocking the others (empty, missing, None, huge, long, unicode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.billing.events import event_from_json
from kvroute.billing.litellm_events import LIMITS, event_from_callback
from kvroute.billing.recorder import UsageRecorder
from kvroute.policies.errors import InputError

text = st.one_of(st.none(), st.just(""), st.text(max_size=8), st.text(min_size=190, max_size=400),
                 st.sampled_from(["\x00", "\ud800", "é" * 250, "x" * 201]))
anything = st.one_of(text, st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
                     st.booleans(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                         st.integers(), max_size=2))
count = st.one_of(st.none(), st.integers(min_value=0, max_value=2**62), st.just(-1), st.just("12"))


@st.composite
def payloads(draw: st.DrawFn) -> tuple[dict, dict, dict]:
    slo = {k: draw(anything) for k in ("id", "litellm_call_id", "model", "model_id", "model_group",
                                       "custom_llm_provider", "api_base", "end_user", "startTime", "endTime",
                                       "completionStartTime", "response_cost", "stream")}
    slo["metadata"] = {"user_api_key_hash": draw(text), "user_api_key_alias": draw(text),
                       "user_api_key_team_id": draw(text), "requester_metadata": {"kvroute_app": draw(anything)}}
    slo["error_information"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
        {"error_code": anything, "error_class": text})))
    kwargs = {"standard_logging_object": slo, "user": draw(anything), "response_cost": draw(anything),
              "model": draw(anything),
              "litellm_params": {"metadata": {"kvroute_attempt": draw(anything), "fallback_depth": draw(anything),
                                              "user_api_key_alias": draw(text)},
                                 "model_info": {"id": draw(anything), "kvroute_route_kind": draw(anything)}}}
    usage = {"prompt_tokens": draw(count), "completion_tokens": draw(count),
             "prompt_tokens_details": {"cached_tokens": draw(count)}, "cost": draw(anything)}
    call = {"outcome": draw(st.sampled_from(["success", "failure", "no_route", "capacity", "cancelled"])),
            "attempt": draw(st.one_of(st.none(), st.integers(min_value=-5, max_value=2**70))),
            "request_id": draw(st.one_of(st.none(), st.text(min_size=1, max_size=300))),
            "final": draw(st.one_of(st.none(), st.booleans()))}
    return kwargs, {"usage": usage, "choices": [{"finish_reason": draw(text)}]}, call


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads())
def test_every_built_event_round_trips_through_replay(payload: tuple[dict, dict, dict]) -> None:
    kwargs, response, call = payload
    try:
        event = event_from_callback(kwargs, response, **call)
    except InputError:
        return  # an inconsistent provider usage: the hook counts it as a billing error (nothing journaled)
    if event is None:
        return
    for name, limit in LIMITS.items():
        value = getattr(event, name)
        assert value is None or (isinstance(value, str) and 0 < len(value) <= limit), (name, value)
    for name in ("attempt", "http_status", "ttft_ms", "duration_ms", "fallback_depth"):
        value = getattr(event, name)
        assert value is None or 0 <= value <= 2**31 - 1, (name, value)
    line = event.to_line()
    line.encode()  # no lone surrogates: the journal line is valid UTF-8
    back = event_from_json(json.loads(line), archive=True)
    assert back.event_id == event.event_id and back.to_line() == line


@pytest.mark.slow
def test_recorder_stores_or_dead_letters_every_generated_event(tmp_path: Path) -> None:
    """Drive the recorder with a sample of generated payloads: each ends in the ledger or the dead letters."""
    events = []

    @settings(max_examples=200, deadline=None, database=None)
    @given(payloads())
    def collect(payload: tuple[dict, dict, dict]) -> None:
        kwargs, response, call = payload
        call["request_id"] = f"r{len(events)}"  # distinct requests, so none collapses into another
        try:
            e = event_from_callback(kwargs, response, **call)
        except InputError:
            return
        if e is not None:
            events.append(e)

    collect()
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    rec = UsageRecorder(url, tmp_path / "journal", flush_interval_s=0.05).start()
    try:
        for e in events:
            rec.record(e)
        assert rec.flush(60)
    finally:
        rec.close()
    distinct = len({e.event_id for e in events})
    assert rec.stats.inserted + rec.stats.dead_lettered >= distinct and rec.stats.drained == len(events)
    assert rec.stats.inserted >= distinct - rec.stats.dead_lettered
