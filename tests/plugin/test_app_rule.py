"""One app rule for metrics, routing rules and the ledger: a request's app is resolved once and every reader gets
the same one. A client's claim counts where its key trusts it, or without a key in the SDK (the operator's own
code); in the proxy an unauthenticated claim counts nowhere."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvroute.billing.attribution import app_of
from kvroute.plugin.adapter.billing_feed import BillingFeed
from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings

MESSAGES = [{"role": "user", "content": "hello"}]


class _Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def record(self, event) -> None:
        self.events.append(event)


def _hosted(i: int) -> dict:
    return {"model_name": "hosted",
            "litellm_params": {"model": "openai/fake-model", "api_base": f"http://127.0.0.1:{9 + i}/v1",
                               "api_key": "x"},
            "model_info": {"id": f"provider-{'ab'[i]}"}}


def _callback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, proxy: bool,
              **settings) -> tuple[KvrouteCallback, _Recorder]:
    if proxy:  # what the plugin looks for to know LiteLLM's proxy (and its auth) runs it
        monkeypatch.setitem(sys.modules, "litellm.proxy.proxy_server", types.ModuleType("litellm.proxy.proxy_server"))
    else:
        monkeypatch.delitem(sys.modules, "litellm.proxy.proxy_server", raising=False)
    cb = KvrouteCallback(KvrouteSettings(data_dir=tmp_path / "d", billing_db="off", **settings),
                         metrics=Metrics(CollectorRegistry()), mount=False)
    cb._setup()
    rec = _Recorder()
    cb.billing = BillingFeed(rec, cb.ids, admission=proxy)
    return cb, rec


def _serve(cb: KvrouteCallback, meta: dict) -> tuple[str | None, str | None]:
    """One request through the hooks (admission, pick, upstream call, success): (the app the pick gave metrics and
    rules, the ledger row's app)."""
    kwargs: dict = {"model": "hosted", "metadata": meta}
    assert cb.billing is not None
    cb.billing.admit(kwargs)  # the proxy's auth admitted it (a no-op for the pick in the SDK)
    backend = cb.filter("hosted", [_hosted(0), _hosted(1)], MESSAGES, kwargs)[0]["model_info"]["id"]
    found = cb.ids.resolve(meta)
    assert found is not None
    picked_app = found[1].app
    cb.pre_call({"model": "openai/fake-model", "model_info": {"id": backend}, "metadata": meta})
    cb.on_success({"litellm_params": {"metadata": meta, "model_info": {"id": backend}}, "model": "fake-model",
                   "standard_logging_object": {"model": "fake-model", "model_id": backend, "model_group": "hosted"}},
                  {"usage": {"prompt_tokens": 5, "completion_tokens": 2}, "choices": [{"finish_reason": "stop"}]},
                  None, None)
    rec = cb.billing.recorder
    return picked_app, rec.events[-1].app_id


def _metric_apps(cb: KvrouteCallback) -> set[str]:
    return {s.labels["app"] for m in cb.metrics.registry.collect() for s in m.samples
            if s.name == "kvroute_app_requests_total"}


def test_sdk_a_claim_without_a_key_counts_in_metrics_and_ledger(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cb, _ = _callback(tmp_path, monkeypatch, proxy=False)
    assert _serve(cb, {"app": "claimed"}) == ("claimed", "claimed")
    assert _serve(cb, {"kvroute_app": "other-app"}) == ("other-app", "other-app")
    assert _metric_apps(cb) == {"claimed", "other-app"}


def test_proxy_an_unauthenticated_claim_counts_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cb, _ = _callback(tmp_path, monkeypatch, proxy=True)
    claim = {"app": "claimed", "requester_metadata": {"app": "claimed", "kvroute_app": "claimed"},
             "headers": {"x-kvroute-app": "claimed"}}
    assert _serve(cb, claim) == (None, "unattributed")
    assert "claimed" not in _metric_apps(cb)
    assert cb.billing is not None and cb.billing.unattributed == 1


def test_proxy_a_key_trusted_for_the_claimed_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cb, _ = _callback(tmp_path, monkeypatch, proxy=True)
    reseller = {"user_api_key_hash": "h-r", "user_api_key_alias": "reseller",
                "user_api_key_metadata": {"kvroute_trusted_apps": ["sub-1", "sub-2"]}}
    assert _serve(cb, {**reseller, "requester_metadata": {"app": "sub-1"}, "app": "sub-1"}) == ("sub-1", "sub-1")
    assert _serve(cb, {**reseller, "headers": {"X-Kvroute-App": "sub-2"}}) == ("sub-2", "sub-2")
    assert _serve(cb, {**reseller, "app": "sub-9"}) == ("reseller", "reseller")  # not on its list: the key's


def test_proxy_the_keys_app_wins_over_an_untrusted_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cb, _ = _callback(tmp_path, monkeypatch, proxy=True)
    meta = {"user_api_key_hash": "h-1", "user_api_key_metadata": {"kvroute_app": "acme"},
            "requester_metadata": {"kvroute_app": "evil"}, "app": "evil"}
    assert _serve(cb, meta) == ("acme", "acme")
    assert _metric_apps(cb) == {"acme"}


def test_the_per_key_label_bound_shapes_metrics_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond ``max_apps_per_key`` a key's apps share the metric label ``other``; the ledger books each app."""
    cb, _ = _callback(tmp_path, monkeypatch, proxy=True, max_apps_per_key=1)
    key = {"user_api_key_hash": "h-r", "user_api_key_alias": "reseller",
           "user_api_key_metadata": {"kvroute_trusted_apps": "*"}}
    assert _serve(cb, {**key, "app": "first"}) == ("first", "first")
    assert _serve(cb, {**key, "app": "second"}) == ("other", "second")


def test_the_rule_itself() -> None:
    key = {"user_api_key_hash": "h", "user_api_key_alias": "alias", "user_api_key_team_id": "team"}
    assert app_of(key) == "team"  # the team comes before the alias
    assert app_of({**key, "user_api_key_metadata": {"kvroute_app": "named"}}) == "named"
    assert app_of({"workload_app": "w"}, claim_keys=("workload_app",)) is None  # a proxy client: no key
    assert app_of({"workload_app": "w"}, claim_keys=("workload_app",), operator_call=True) == "w"
    assert app_of({**key, "app": "x"}, claim_keys=("app",), operator_call=True) == "team"  # a key: its own app
    assert app_of({"user_api_key_hash": "h", "app": "x"}, claim_keys=("app",), operator_call=True) is None
