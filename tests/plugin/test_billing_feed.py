"""Billing target (on by default in the proxy, ``off`` disables) and the per-key bound on app labels."""

from __future__ import annotations

from pathlib import Path

from feed_doubles import Recorder as _Recorder
from feed_doubles import UpstreamError as _Exc
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.billing_feed import billing_target
from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings


def test_on_by_default_in_the_proxy_off_disables(tmp_path: Path) -> None:
    s = KvrouteSettings(data_dir=tmp_path / "d")
    db, journal, dead = billing_target(s, in_proxy=True)  # type: ignore[misc]
    assert db == f"sqlite:///{tmp_path / 'd' / 'billing.db'}" and journal == tmp_path / "d" / "journal"
    assert dead == tmp_path / "d"
    assert billing_target(s, in_proxy=False) is None  # the SDK records only when asked
    assert billing_target(KvrouteSettings(billing_db="off"), in_proxy=True) is None
    assert billing_target(KvrouteSettings(billing_db="OFF", billing=True), in_proxy=False) is None
    pg = billing_target(KvrouteSettings(billing_db="postgresql+psycopg://u@h/db"), in_proxy=False)
    assert pg is not None and pg[0] == "postgresql+psycopg://u@h/db"


def _cb(**settings) -> KvrouteCallback:
    return KvrouteCallback(KvrouteSettings(**settings), metrics=Metrics(CollectorRegistry()), mount=False)


def test_app_comes_from_the_key_and_claims_only_where_the_key_allows() -> None:
    cb = _cb()
    keyed = {"user_api_key_hash": "h1", "user_api_key_alias": "acme", "app": "evil"}
    assert cb.app_of(keyed, {}) == "acme"
    trusting = {"user_api_key_hash": "h2", "user_api_key_alias": "reseller", "app": "sub-1",
                "user_api_key_metadata": {"kvroute_trusted_apps": ["*"]}}
    assert cb.app_of(trusting, {}) == "sub-1"
    assert cb.app_of({"app": "sdk-app"}, {}) == "sdk-app"  # no key at all (SDK): the caller is the operator


def test_label_cardinality_is_bounded_per_key() -> None:
    cb = _cb(max_apps_per_key=3)
    base = {"user_api_key_hash": "h", "user_api_key_alias": "r", "user_api_key_metadata": {"kvroute_trusted_apps": "*"}}
    apps = [cb.app_of({**base, "app": f"junk{i}"}, {}) for i in range(60)]
    assert apps[:3] == ["junk0", "junk1", "junk2"] and set(apps[3:]) == {"other"}
    assert cb.app_of({**base, "user_api_key_hash": "h-other", "app": "fine"}, {}) == "fine"  # another key's budget


class _Resp:
    def __init__(self, model_id: str) -> None:
        self.usage = {"prompt_tokens": 10, "completion_tokens": 3}
        self.choices = [{"finish_reason": "stop"}]
        self._hidden_params = {"model_id": model_id, "response_cost": 0.0001, "custom_llm_provider": "openai"}


def test_attempt_lifecycle_each_outcome_once_with_its_own_status() -> None:
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    top: dict = {"user_api_key_alias": "acme"}
    data = {"model": "llama", "metadata": top, "user": "u1"}
    ids.new_attempt(top, "llama", None)  # LiteLLM had no deployment for llama: a router-level hop
    feed.logged_failure({"model": "llama", "litellm_params": {"metadata": top}},
                        _Exc("No deployments available for selected model", 429))
    m2 = dict(top)  # the fallback hop's copy
    _, a2 = ids.new_attempt(m2, "hosted", "h-0")
    t2 = a2.ticket
    call2 = {"model": "openai/fake", "model_info": {"id": "h-0"}, "metadata": m2}
    feed.attempt_started(a2, call2)
    feed.attempt_failed(call2, _Exc("boom", 500), t2)
    m3 = dict(m2)
    _, a3 = ids.new_attempt(m3, "hosted", "h-1")
    t3 = a3.ticket
    call3 = {"model": "openai/fake", "model_info": {"id": "h-1"}, "metadata": m3}
    feed.attempt_started(a3, call3)
    feed.pre_response(data, _Resp("h-1"))
    success_kwargs = {"litellm_params": {"metadata": m3, "model_info": {"id": "h-1"}}, "model": "fake",
                      "standard_logging_object": {"model": "fake", "model_id": "h-1", "model_group": "hosted"}}
    feed.success(success_kwargs, _Resp("h-1"), None, None, t3)
    feed.success(success_kwargs, _Resp("h-1"), None, None, t3)  # a replayed callback
    feed.request_failed(data, _Exc("late", 500))  # the request succeeded: no outcome row
    by_id = {e.event_id: e for e in rec.events}
    rows = sorted(by_id.values(), key=lambda e: e.attempt)
    assert [(e.attempt, e.status, e.is_final, e.backend_id) for e in rows] == [
        (1, "no_route", False, "router"), (2, "provider_failure", False, "h-0"), (3, "success", True, "h-1")]
    assert rows[0].provider == "litellm-router" and rows[2].http_status is None  # not the earlier exception's
    assert len({e.request_id for e in rows}) == 1 and {e.app_id for e in rows} == {"acme"}


def test_a_failed_request_gets_one_final_outcome_row() -> None:
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    meta: dict = {}
    _, a1 = ids.new_attempt(meta, "llama", "r-0")
    t1 = a1.ticket
    call = {"model": "openai/fake", "model_info": {"id": "r-0"}, "metadata": meta}
    feed.attempt_started(a1, call)
    feed.attempt_failed(call, _Exc("boom", 500), t1)
    feed.request_failed({"model": "llama", "metadata": meta}, _Exc("boom", 500))
    feed.request_failed({"model": "llama", "metadata": meta}, _Exc("boom", 500))  # fired twice
    assert [(e.status, e.is_final, e.attempt_key) for e in rec.events] == [
        ("provider_failure", False, None), ("provider_failure", True, "outcome")]
    assert feed.request_failed({"model": "llama", "metadata": {}}, _Exc("bad request", 400)) is None
    assert len(rec.events) == 2  # never routed: not usage


def test_a_router_level_final_outcome_is_booked_on_the_router_not_on_the_pick() -> None:
    """kvroute picked ``p-a``, then LiteLLM refused before any upstream call (its global budget): the final
    ``no_route`` row names backend ``router``; a backend that was called and failed keeps the row."""
    import litellm

    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    meta: dict = {}
    ids.new_attempt(meta, "hosted", "p-a")
    feed.request_failed({"model": "hosted", "metadata": meta},
                        litellm.BudgetExceededError(current_cost=0.0, max_budget=-1.0))
    assert [(e.status, e.is_final, e.backend_id) for e in rec.events] == [("no_route", True, "router")]

    meta = {}
    _, a1 = ids.new_attempt(meta, "llama", "r-0")
    t1 = a1.ticket
    call = {"model": "openai/fake", "model_info": {"id": "r-0"}, "metadata": meta}
    feed.attempt_started(a1, call)
    feed.attempt_failed(call, _Exc("boom", 500), t1)
    feed.request_failed({"model": "llama", "metadata": meta}, _Exc("boom", 500))
    assert [(e.status, e.is_final, e.backend_id) for e in rec.events[1:]] == [
        ("provider_failure", False, "r-0"), ("provider_failure", True, "r-0")]


class _Chunk:
    """A stream chunk shaped like LiteLLM's ``ModelResponseStream`` (only what the feed reads)."""

    def __init__(self, content: str | None) -> None:
        self.choices = [type("Choice", (), {"delta": type("Delta", (), {"content": content})(), "text": None})()]


def test_a_stream_cut_after_output_is_a_paid_failed_attempt_absorbed() -> None:
    """The proxy relayed 2 output chunks from h-1 (a fallback hop), then the provider cut the stream: h-1's own
    non-final row carries the prompt + 2 output tokens at its per-token prices; the outcome row costs nothing."""
    from decimal import Decimal

    from kvroute.billing.pricing import rate_event
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds
    from kvroute.plugin.adapter.signals import chunk_has_output

    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    meta: dict = {}
    _, a1 = ids.new_attempt(meta, "llama", "r-0")
    t1 = a1.ticket
    call1 = {"model": "openai/fake", "model_info": {"id": "r-0"}, "metadata": meta}
    feed.attempt_started(a1, call1)
    feed.attempt_failed(call1, _Exc("boom", 500), t1)  # no output: costs nothing
    m2 = dict(meta)
    _, a2 = ids.new_attempt(m2, "hosted", "h-1")
    feed.attempt_started(a2, {"model": "openai/fake", "metadata": m2, "model_info": {
        "id": "h-1", "input_cost_per_token": 1e-06, "output_cost_per_token": 2e-06}})
    chunks = [_Chunk(""), _Chunk("Hello"), _Chunk(None), _Chunk(" world")]
    assert [chunk_has_output(c) for c in chunks] == [False, True, False, True]
    data = {"model": "llama", "metadata": meta, "user": "u1",  # the request's metadata names the first hop
            "messages": [{"role": "user", "content": "one two three four five six seven eight"}]}
    feed.stream_cut(data, sum(map(chunk_has_output, chunks)))
    feed.request_failed(data, _Exc("litellm.APIConnectionError: Connection error.", 500))
    rows = [(e.backend_id, e.is_final, e.attempt_key, e.tokens.prompt_total, e.tokens.output) for e in rec.events]
    assert rows[0] == ("r-0", False, None, 0, 0) and rows[2][:2] == ("h-1", True) and rows[2][3:] == (0, 0)
    paid = rec.events[1]
    assert (paid.backend_id, paid.is_final, paid.status, paid.tokens.output) == ("h-1", False, "provider_failure", 2)
    prompt = paid.tokens.prompt_total
    assert prompt > 0 and paid.raw_usage["kvroute_estimate"] == "stream_cut"
    assert paid.litellm_cost == Decimal("0.000001") * prompt + Decimal("0.000002") * 2
    rating = rate_event(paid, None, None)
    assert rating.billed_amount == 0 and rating.absorbed_cost == rating.provider_cost == paid.litellm_cost


def test_cut_stream_usage_without_prices_leaves_the_cost_to_the_rate_card() -> None:
    from kvroute.billing.litellm_events import cut_stream_usage
    usage, cost = cut_stream_usage(40, 3, {"input_cost_per_token": 0.0})
    assert (usage["prompt_tokens"], usage["completion_tokens"], cost) == (40, 3, None)
    usage, cost = cut_stream_usage(-5, 2, {"input_cost_per_token": "0.5", "output_cost_per_token": 1})
    assert usage["prompt_tokens"] == 0 and cost == 2


def test_metrics_show_the_drainer_process_progress(tmp_path: Path) -> None:
    """The proxy's billing metrics come from the out-of-process drainer: stored rows, journal lag, database up."""
    import os
    import time
    from datetime import UTC, datetime

    from kvroute.billing.drain import read_stats
    from kvroute.billing.events import UsageEvent
    from kvroute.billing.recorder import UsageRecorder
    from kvroute.billing.usage import TokenBuckets
    from kvroute.plugin.adapter.billing_feed import BillingFeed, RecorderCollector
    from kvroute.plugin.adapter.request_ids import RequestIds

    rec = UsageRecorder(f"sqlite:///{tmp_path / 'b.db'}", tmp_path / "journal", flush_interval_s=0.05).start()
    try:
        collector = RecorderCollector(BillingFeed(rec, RequestIds()))

        def metrics() -> dict[str, float]:
            return {m.name: m.samples[0].value for m in collector.collect()}

        for i in range(50):
            rec.record(UsageEvent(request_id=f"r{i}", app_id="acme", occurred_at=datetime.now(UTC), served_model="m",
                                  provider="p", backend_id="b", tokens=TokenBuckets(5, 0, 0, 0, 2, 0)))
        assert metrics()["kvroute_billing_events_recorded"] == 50
        assert rec.flush(30)
        deadline = time.monotonic() + 10
        while metrics()["kvroute_billing_db_up"] != 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        m = metrics()
        assert m["kvroute_billing_events_inserted"] == 50 and m["kvroute_billing_journal_pending_bytes"] == 0
        assert read_stats(tmp_path / "journal")["pid"] != os.getpid()
    finally:
        rec.close()


def test_in_the_proxy_only_requests_auth_admitted_reach_the_ledger() -> None:
    """A router-level failure of a request LiteLLM's auth never admitted (no ``async_pre_call_hook``) adds no row
    and is counted; the same failure after ``admit`` is booked as ``no_route`` on ``router``."""
    import litellm

    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    rec = _Recorder()
    feed = BillingFeed(rec, RequestIds(), admission=True)
    refused = {"model": "hosted", "metadata": {"kvroute_request_id": "forged"}}
    budget = litellm.BudgetExceededError(current_cost=1.0, max_budget=0.5)
    feed.logged_failure(refused, budget)
    feed.request_failed(refused, budget)
    assert rec.events == [] and feed.refused_unadmitted == 2
    admitted: dict = {"model": "hosted", "metadata": {}}
    feed.admit(admitted)
    feed.request_failed(admitted, budget)
    assert [(e.status, e.is_final, e.backend_id) for e in rec.events] == [("no_route", True, "router")]


def test_startup_line_says_where_billing_records(tmp_path: Path, monkeypatch) -> None:
    from kvroute.plugin.adapter.startup_log import startup_line

    monkeypatch.chdir(tmp_path)
    cb = _cb(billing=True)  # the SDK records when asked; the proxy by default, to the same place
    cb._setup()
    try:
        line = startup_line(cb)
        assert "billing sqlite .kvroute/billing.db (journal .kvroute/journal);" in line, line
        assert (tmp_path / ".kvroute" / "journal").is_dir()
    finally:
        cb.billing.close()  # type: ignore[union-attr]
    off = _cb()
    off._setup()
    assert "billing off;" in startup_line(off)
    from kvroute.plugin.adapter.billing_feed import describe_target

    pg = describe_target("postgresql+psycopg://kv:secret@127.0.0.1:1/none", tmp_path / "j")
    assert pg == "postgresql+psycopg://kv:***@127.0.0.1:1/none (journal j)", pg


def _success(feed, ids, meta: dict, backend: str, *, streamed: bool, hidden_provider: str | None) -> None:
    """One request served by ``backend`` and recorded before the response (the proxy's path, stream or not)."""
    _, attempt = ids.new_attempt(meta, "hosted", backend)
    feed.attempt_started(attempt, {"model": "openai/fake-model", "model_info": {"id": backend}, "metadata": meta})
    resp = _Resp(backend)
    resp._hidden_params["custom_llm_provider"] = hidden_provider  # LiteLLM names it only when not streamed
    feed.pre_response({"model": "hosted", "metadata": meta}, resp, streamed=streamed)


def test_streamed_and_not_carry_the_deployments_provider() -> None:
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    ids, rec = RequestIds(), _Recorder()
    feed = BillingFeed(rec, ids)
    feed.provider_of = {"provider-a": "provider-a"}.get
    _success(feed, ids, {"user_api_key_alias": "acme"}, "provider-a", streamed=False, hidden_provider="openai")
    _success(feed, ids, {"user_api_key_alias": "acme"}, "provider-a", streamed=True, hidden_provider=None)
    assert [(e.provider, e.streamed) for e in rec.events] == [("provider-a", False), ("provider-a", True)]


def test_unattributed_requests_are_counted_and_warned_about_once_a_minute(caplog) -> None:
    from kvroute.plugin.adapter import billing_feed as bf
    from kvroute.plugin.adapter.request_ids import RequestIds

    ids, rec = RequestIds(), _Recorder()
    feed = bf.BillingFeed(rec, ids)
    with caplog.at_level("WARNING", logger="kvroute.plugin"):
        for _ in range(3):
            _success(feed, ids, {"user_api_key_hash": "master"}, "p", streamed=False, hidden_provider="openai")
        _success(feed, ids, {"user_api_key_alias": "acme"}, "p", streamed=False, hidden_provider="openai")
    assert [e.app_id for e in rec.events] == ["unattributed"] * 3 + ["acme"]
    assert feed.unattributed == 3
    warnings = [r.getMessage() for r in caplog.records if "unattributed" in r.getMessage()]
    assert len(warnings) == 1 and "1 request(s)" in warnings[0]  # the first one; the next within the minute
    feed._unattributed_warned_at -= bf.UNATTRIBUTED_WARN_EVERY_S  # a minute later
    with caplog.at_level("WARNING", logger="kvroute.plugin"):
        _success(feed, ids, {"user_api_key_hash": "master"}, "p", streamed=False, hidden_provider="openai")
    warnings = [r.getMessage() for r in caplog.records if "unattributed" in r.getMessage()]
    assert len(warnings) == 2 and "4 request(s)" in warnings[1]
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    feed.recorder.stats = type("S", (), {"recorded": 0, "inserted": 0, "dead_lettered": 0, "journal_errors": 0})()
    feed.recorder.pending_bytes, feed.recorder.db_available = 0, True
    registry.register(bf.RecorderCollector(feed))
    assert "kvroute_billing_unattributed_requests_total 4.0" in generate_latest(registry).decode()
