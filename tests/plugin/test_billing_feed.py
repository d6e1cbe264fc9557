"""Billing target (on by default in the proxy, ``off`` disables) and the per-key bound on app labels."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from kvroute.plugin.billing_feed import billing_target
from kvroute.plugin.litellm_hooks import KvrouteCallback
from kvroute.plugin.metrics import Metrics
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
    assert cb._app(keyed, {}) == "acme"
    trusting = {"user_api_key_hash": "h2", "user_api_key_alias": "reseller", "app": "sub-1",
                "user_api_key_metadata": {"kvroute_trusted_apps": ["*"]}}
    assert cb._app(trusting, {}) == "sub-1"
    assert cb._app({"app": "sdk-app"}, {}) == "sdk-app"  # no key at all (SDK): the caller is the operator


def test_label_cardinality_is_bounded_per_key() -> None:
    cb = _cb(max_apps_per_key=3)
    base = {"user_api_key_hash": "h", "user_api_key_alias": "r", "user_api_key_metadata": {"kvroute_trusted_apps": "*"}}
    apps = [cb._app({**base, "app": f"junk{i}"}, {}) for i in range(60)]
    assert apps[:3] == ["junk0", "junk1", "junk2"] and set(apps[3:]) == {"other"}
    assert cb._app({**base, "user_api_key_hash": "h-other", "app": "fine"}, {}) == "fine"  # another key's budget
