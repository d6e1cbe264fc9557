"""Which cancel billing a backend gets: its model_info, else the price file in the ledger, else its provider's."""

from __future__ import annotations

from pathlib import Path

from feed_doubles import Recorder

from kvroute.billing.ledger import Ledger
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.plugin.adapter.billing_feed import BillingFeed
from kvroute.plugin.adapter.request_ids import RequestIds


def test_model_info_then_the_loaded_price_file_then_the_providers_known_mode(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(db)
    try:
        store_prices(ledger, parse_price_data({"cancel_billing": {"acme-cloud": "none"},
                                               "backends": [{"id": "declared", "provider": "acme-cloud"},
                                                            {"id": "own", "provider": "bedrock",
                                                             "cancel_billing": "relayed"}]}))
    finally:
        ledger.engine.dispose()
    feed = BillingFeed(Recorder(), RequestIds())
    feed.db_url = db
    providers = {"declared": "acme-cloud", "own": "bedrock", "plain": "bedrock", "other": "openai"}
    feed.provider_of = providers.get
    assert feed.cancel_billing_of("declared") == "none"  # the file's provider-level declaration
    assert feed.cancel_billing_of("own") == "relayed"  # the backend's own line beats bedrock's known "full"
    assert feed.cancel_billing_of("plain") == "full" and feed.cancel_billing_of("other") == "relayed"
    assert feed.cancel_billing_of("declared", {"kvroute_cancel_billing": "full"}) == "full"  # the deployment wins
    assert feed.cancel_billing_of("plain", {"kvroute_cancel_billing": "most"}) == "full"  # a typo: the provider's
