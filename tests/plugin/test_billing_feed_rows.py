"""Rows the feed states from kvroute's own attempt record, with no LiteLLM payload to read: a success recorded
before the response, a router-level hop, a superseded attempt, a request's final outcome, a cut stream's cost.
Every column is pinned to values worked out by hand from the inputs."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from feed_doubles import Recorder as _Recorder
from feed_doubles import UpstreamError as _Exc

from kvroute.plugin.adapter.billing_feed import BillingFeed
from kvroute.plugin.adapter.request_ids import RequestIds

KEY = {"user_api_key_alias": "acme", "user_api_key_hash": "kh-1"}
PRICED = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
ZERO = {"prompt_tokens": 0, "completion_tokens": 0}
COLUMNS = ("app_id", "attempt", "attempt_key", "status", "is_final", "backend_id", "provider", "route_kind",
           "served_model", "requested_model", "streamed", "litellm_cost", "provider_cost", "end_user",
           "api_key_hash", "raw_usage", "http_status", "error_type", "fallback_depth")


class _NoRoute(Exception):
    status_code = 429

    def __init__(self) -> None:
        super().__init__("No deployments available for selected model")


class _Resp:
    def __init__(self, model_id: str, usage: dict, finish: str | None = "stop") -> None:
        self.usage = usage
        self.choices = [{"finish_reason": finish}]
        self._hidden_params = {"model_id": model_id, "response_cost": 0.0001, "custom_llm_provider": "openai"}


def _feed() -> tuple[BillingFeed, RequestIds, _Recorder]:
    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    feed.kind_of = {"r-0": "self_hosted", "h-0": "direct"}.get
    feed.provider_of = {"r-0": "vllm", "h-0": "openai"}.get
    feed.served_of = {"r-0": "llama-8b", "h-0": "gpt-x"}.get
    return feed, ids, rec


def _sent(feed: BillingFeed, ids: RequestIds, meta: dict, backend: str, served: str, info: dict | None = None):
    state, attempt = ids.new_attempt(meta, "llama", backend)
    attempt.started = ids.clock()  # as the pre-call hook notes the upstream call
    feed.attempt_started(attempt, {"model": served, "model_info": {"id": backend, **(info or {})}, "metadata": meta})
    return state, attempt


def _event_id(app: str, request_id: str, attempt: Any) -> str:
    return hashlib.sha256(f"{app}|{request_id}|{attempt}".encode()).hexdigest()[:32]


def _row(event) -> dict:
    return {c: getattr(event, c) for c in COLUMNS}


def _expect(**over: Any) -> dict:
    base = {"app_id": "acme", "attempt": 1, "attempt_key": None, "is_final": False, "streamed": False,
            "litellm_cost": None, "provider_cost": None, "end_user": None, "api_key_hash": "kh-1",
            "raw_usage": ZERO, "http_status": None, "error_type": None, "fallback_depth": 0}
    return {**base, **over}


def test_a_success_recorded_before_the_response() -> None:
    feed, ids, rec = _feed()
    meta = {**KEY, "fallback_depth": 2}
    state, attempt = _sent(feed, ids, meta, "r-0", "openai/llama-8b")
    feed.pre_response({"model": "llama", "metadata": meta, "user": "cust-1"},
                      _Resp("r-0", {"prompt_tokens": 10, "completion_tokens": 3}))
    (e,) = rec.events
    assert _row(e) == _expect(status="success", is_final=True, backend_id="r-0", provider="vllm",
                              route_kind="self_hosted", served_model="llama-8b", requested_model="llama",
                              litellm_cost=Decimal("0.0001"), end_user="cust-1",
                              raw_usage={"prompt_tokens": 10, "completion_tokens": 3}, fallback_depth=2)
    assert e.event_id == _event_id("acme", state.request_id, 1) and e.occurred_at == ids.wall(attempt.started)
    assert abs((e.occurred_at - datetime.now(UTC)).total_seconds()) < 60
    assert feed.before_response == 1 and attempt.recorded and state.final == "success"


def test_a_streamed_success_with_litellms_stamp_on_its_usage() -> None:
    """The stream's usage carries LiteLLM's own bill as ``cost``: LiteLLM's cost, not a provider report."""
    feed, ids, rec = _feed()
    meta = dict(KEY)
    state, _ = _sent(feed, ids, meta, "h-0", "openai/gpt-x")
    chunk = _Resp("h-0", {"prompt_tokens": 12, "completion_tokens": 4, "cost": 0.0001}, finish=None)
    feed.pre_response({"model": "llama", "metadata": meta}, chunk,
                      hidden={"model_id": "h-0", "response_cost": 0.0001, "custom_llm_provider": "openrouter"},
                      streamed=True)
    (e,) = rec.events
    assert _row(e) == _expect(status="success", is_final=True, backend_id="h-0", provider="openai",
                              route_kind="direct", served_model="gpt-x", requested_model="llama", streamed=True,
                              litellm_cost=Decimal("0.0001"), raw_usage={"prompt_tokens": 12, "completion_tokens": 4})
    assert e.event_id == _event_id("acme", state.request_id, 1)


def test_router_level_hops_on_backend_router() -> None:
    """A hop kvroute counted keeps its attempt number; one it never saw is told apart by its model."""
    feed, ids, rec = _feed()
    hop_meta = dict(KEY)
    hop_state, _ = ids.new_attempt(hop_meta, "llama", None)
    feed.logged_failure({"model": "llama", "litellm_params": {"metadata": hop_meta}, "user": "u-9"}, _NoRoute())
    bare_meta = dict(KEY)
    bare_state = ids.begin(bare_meta)
    feed.logged_failure({"model": "hosted", "litellm_params": {"metadata": bare_meta}}, _NoRoute())
    hop, bare = rec.events
    router = {"status": "no_route", "backend_id": "router", "provider": "litellm-router", "route_kind": "direct",
              "http_status": 429, "error_type": "_NoRoute"}
    assert _row(hop) == _expect(**router, served_model="llama", requested_model="llama", end_user="u-9")
    assert _row(bare) == _expect(**router, attempt=0, attempt_key="no_route:hosted", served_model="hosted",
                                 requested_model="hosted")
    assert hop.event_id == _event_id("acme", hop_state.request_id, 1)
    assert bare.event_id == _event_id("acme", bare_state.request_id, "no_route:hosted")


def test_a_superseded_attempt_with_and_without_output() -> None:
    """A new pick arrived before the attempt's outcome: one row. Output it streamed reached its provider and is
    billed as a cut stream (prompt unknown: 0 tokens; 3 output tokens at 2e-6); an attempt no hook described and
    that relayed nothing was refused before any call (a budget), ``no_route`` on ``router`` like the request's
    own refusal."""
    feed, ids, rec = _feed()
    meta = dict(KEY)
    state, first = _sent(feed, ids, meta, "r-0", "openai/llama-8b", PRICED)
    first.streamed = 3
    request = {"metadata": meta, "user": "cust-7", "stream": True}  # the request's own key, end user and stream
    feed.superseded(first.ticket, request)
    _, second = _sent(feed, ids, dict(meta), "h-0", "openai/gpt-x", {"kvroute_route_kind": "marketplace"})
    feed.superseded(second.ticket, request)
    feed.superseded(second.ticket, request)  # once only
    paid, unpaid = rec.events
    cut = {"prompt_tokens": 0, "completion_tokens": 3, "total_tokens": 3, "kvroute_estimate": "stream_cut"}
    assert _row(paid) == _expect(status="provider_failure", backend_id="r-0", provider="vllm",
                                 route_kind="self_hosted", served_model="llama-8b", requested_model="openai/llama-8b",
                                 litellm_cost=Decimal("0.000006"), raw_usage=cut, end_user="cust-7",
                                 streamed=True)
    assert _row(unpaid) == _expect(status="no_route", attempt=2, backend_id="router", provider="litellm-router",
                                   route_kind="direct", served_model="llama", requested_model="llama",
                                   end_user="cust-7")
    assert paid.event_id == _event_id("acme", state.request_id, 1) and paid.occurred_at == ids.wall(first.started)
    assert unpaid.event_id == _event_id("acme", state.request_id, 2)


def test_failed_attempts_pay_for_the_output_of_a_cut_stream() -> None:
    """The per-attempt hook's row of a stream the proxy relayed 2 chunks of (prompt unknown), and LiteLLM's failure
    event for an attempt whose partial stream it counted (9 prompt, 4 output tokens)."""
    feed, ids, rec = _feed()
    meta = dict(KEY)
    state, relayed = _sent(feed, ids, meta, "h-0", "openai/gpt-x", PRICED)
    feed.stream_cut({"metadata": meta}, 2)
    feed.attempt_failed({"model": "openai/gpt-x", "model_info": relayed.model_info, "metadata": meta},
                        _Exc("reset", 502), relayed.ticket)
    counted_meta = dict(meta)
    _, counted = _sent(feed, ids, counted_meta, "r-0", "openai/llama-8b", PRICED)
    slo = {"model_id": "r-0", "prompt_tokens": 9, "completion_tokens": 4, "custom_llm_provider": "hosted_vllm"}
    params = {"metadata": counted_meta, "model_info": counted.model_info}
    feed.logged_failure({"model": "llama", "litellm_params": params, "standard_logging_object": slo},
                        _Exc("late", 503), status="capacity")
    first, second = rec.events
    assert _row(first) == _expect(status="provider_failure", backend_id="h-0", provider="openai", route_kind="direct",
                                  served_model="gpt-x", requested_model="openai/gpt-x",
                                  litellm_cost=Decimal("0.000004"), http_status=502, error_type="UpstreamError",
                                  raw_usage={"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2,
                                             "kvroute_estimate": "stream_cut"})
    assert _row(second) == _expect(status="capacity", attempt=2, backend_id="r-0", provider="vllm",
                                   route_kind="self_hosted", served_model="llama-8b", requested_model="llama",
                                   litellm_cost=Decimal("0.000017"), http_status=503, error_type="UpstreamError",
                                   raw_usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                                              "kvroute_estimate": "stream_cut"})
    assert [e.event_id for e in rec.events] == [_event_id("acme", state.request_id, n) for n in (1, 2)]


def test_a_failed_request_after_a_cut_stream_and_its_final_outcome() -> None:
    """The cut stream's own row (5 chunks relayed, prompt unknown), then the request's outcome row; both carry the
    route kind the deployment declares (over the fleet's ``direct``)."""
    feed, ids, rec = _feed()
    meta = dict(KEY)
    state, _ = _sent(feed, ids, meta, "h-0", "openai/gpt-x", {**PRICED, "kvroute_route_kind": "marketplace"})
    data = {"model": "llama", "metadata": meta, "user": "cust-2"}
    feed.stream_cut(data, 5)
    feed.request_failed(data, _Exc("cut", 502))
    feed.request_failed(data, _Exc("cut", 502))  # fired twice: one outcome row
    cut, outcome = rec.events
    failed = {"status": "provider_failure", "backend_id": "h-0", "provider": "openai", "route_kind": "marketplace",
              "served_model": "gpt-x", "end_user": "cust-2", "http_status": 502, "error_type": "UpstreamError"}
    assert _row(cut) == _expect(**failed, requested_model="openai/gpt-x", litellm_cost=Decimal("0.00001"),
                                raw_usage={"prompt_tokens": 0, "completion_tokens": 5, "total_tokens": 5,
                                           "kvroute_estimate": "stream_cut"})
    assert _row(outcome) == _expect(**failed, attempt_key="outcome", is_final=True, requested_model="llama")
    assert cut.event_id == _event_id("acme", state.request_id, 1)
    assert outcome.event_id == _event_id("acme", state.request_id, "outcome") and state.final == "failed"


def test_a_router_level_final_outcome_after_a_hop() -> None:
    feed, ids, rec = _feed()
    meta = dict(KEY)
    state, _ = ids.new_attempt(meta, "hosted", None)
    feed.request_failed({"model": "hosted", "metadata": meta}, _NoRoute())
    (e,) = rec.events
    assert _row(e) == _expect(status="no_route", attempt_key="outcome", is_final=True, backend_id="router",
                              provider="litellm-router", route_kind="direct", served_model="hosted",
                              requested_model="hosted", http_status=429, error_type="_NoRoute")
    assert e.event_id == _event_id("acme", state.request_id, "outcome")


def test_every_row_of_a_request_carries_its_session_and_tags() -> None:
    """The session the client names (``x-session-id``, any case, or metadata) and the metadata tags reach every
    ledger row of the request, fitted to their columns; ``user`` is the end user, never a session."""
    feed, ids, rec = _feed()
    meta = {**KEY, "headers": {"X-Session-Id": "sess-42"}, "tags": ["team:a", "batch", "x" * 150],
            "workload": "agent"}
    state, attempt = _sent(feed, ids, meta, "h-0", "openai/gpt-x")
    feed.attempt_failed({"model": "gpt-x", "metadata": meta, "model_info": {"id": "h-0"}}, _Exc("boom", 500),
                        found=(state, attempt))
    _sent(feed, ids, meta, "r-0", "openai/llama-8b")
    feed.pre_response({"model": "llama", "metadata": meta, "user": "cust-1"},
                      _Resp("r-0", {"prompt_tokens": 10, "completion_tokens": 3}))
    assert len(rec.events) == 2
    long_tag = next(t for e in rec.events for t in e.tags if t.startswith("xxx"))
    for e in rec.events:
        assert e.session_id == "sess-42"
        assert e.tags == tuple(sorted(("batch", "team:a", "workload:agent", long_tag)))
    assert len(long_tag) == 100 and long_tag.startswith("x" * 87 + "~")
    feed2, ids2, rec2 = _feed()
    meta2 = {**KEY, "conversation_id": "conv-1", "headers": {"x-session-id": "ignored: metadata first"}}
    _sent(feed2, ids2, meta2, "r-0", "openai/llama-8b")
    feed2.pre_response({"model": "llama", "metadata": meta2, "user": "cust-1"},
                       _Resp("r-0", {"prompt_tokens": 1, "completion_tokens": 1}))
    feed3, ids3, rec3 = _feed()
    meta3 = dict(KEY)
    _sent(feed3, ids3, meta3, "r-0", "openai/llama-8b")
    feed3.pre_response({"model": "llama", "metadata": meta3, "user": "cust-1"},
                       _Resp("r-0", {"prompt_tokens": 1, "completion_tokens": 1}))
    assert [(e.session_id, e.tags) for e in rec2.events + rec3.events] == [("conv-1", ()), (None, ())]
