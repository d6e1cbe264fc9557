"""The ``hybrid:`` block of a group: strict like every other key, errors name the key, it builds the policy."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvroute.plugin.settings import load_settings
from kvroute.policies import FleetView, Hybrid, Router, build_policy
from kvroute.policies.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_hybrid_block_is_the_hybrid_policy_with_its_knobs(tmp_path):
    s = load_settings(write(tmp_path, """
kvroute:
  groups:
    chat:
      hybrid: {ttft_target_s: 0.8, max_overflow_share: 0.4, max_hosted_spend_per_hour: "12.50",
               app_targets: {voice: 0.3}, tag_targets: {"workload:batch": 30}}
"""))
    name, knobs = s.group("chat").policy_knobs
    assert name == "hybrid" and knobs["ttft_target_s"] == 0.8
    policy = Router().set_policy("chat", name, knobs)
    assert isinstance(policy, Hybrid) and policy.config.max_hosted_spend_per_hour == Decimal("12.50")
    assert policy.guard.max_share == 0.4


@pytest.mark.parametrize(("text", "key"), [
    ("chat: {hybrid: {ttft_target_s: -1}}", "kvroute.groups.chat.hybrid.ttft_target_s"),
    ("chat: {hybrid: {ttft_target: 1}}", "kvroute.groups.chat.hybrid.ttft_target"),
    ("chat: {hybrid: {max_overflow_share: 2}}", "kvroute.groups.chat.hybrid.max_overflow_share"),
    ("chat: {hybrid: {max_hosted_spend_per_hour: lots}}", "kvroute.groups.chat.hybrid.max_hosted_spend_per_hour"),
    ("chat: {hybrid: {}, policy: cache_aware}", "kvroute.groups.chat.hybrid"),
    ("chat: {hybrid: {}, kind: hosted}", "kvroute.groups.chat.kind"),
    ("chat: {hybrid: [1]}", "kvroute.groups.chat.hybrid"),
])
def test_bad_hybrid_blocks_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"kvroute:\n  groups:\n    {text}\n"))
    assert err.value.key == key or err.value.key.startswith(key), err.value


def test_the_fleet_tells_the_policy_which_backends_are_hosted_and_what_a_replica_token_costs():
    from kvroute.plugin.adapter import hybrid
    from kvroute.plugin.adapter.deployments import Backend

    fleet = [Backend("gpu-1", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7"),
                     output_price=Decimal("8e-7")),
             Backend("gpu-2", "chat", "m", "self_hosted", "vllm"),
             Backend("prov", "chat", "m", "hosted", "openai_compatible", input_price=Decimal("2e-6"),
                     output_price=Decimal("8e-6"))]
    router = Router()
    policy = router.set_policy("chat", "hybrid", {})
    router.bind(policy, FleetView(sides=lambda: hybrid.route_sides(fleet)))
    assert policy.is_hosted("prov") and not policy.is_hosted("gpu-1")
    rate = policy.self_rate("gpu-1")
    assert rate is not None and rate.price(1000, 10) == Decimal("2e-7") * 1000 + Decimal("8e-7") * 10
    assert policy.self_rate("gpu-2") is None  # unpriced replica, no default rate configured
    rule_policy = build_policy("hybrid", {"ttft_target_s": 0.2})  # a rule's own policy in the same group
    router.bind(rule_policy, FleetView())
    assert rule_policy.guard is policy.guard and rule_policy.market is policy.market
    assert hybrid.status_of(policy, 0.0)["hybrid"]["mode"] == "normal"
    assert hybrid.status_of(build_policy("cache_aware"), 0.0) == {}


def test_a_replicas_rate_card_in_the_ledger_wins_over_its_model_list_price(tmp_path):
    from kvroute.billing.ledger import Ledger
    from kvroute.billing.price_file import parse_price_data
    from kvroute.billing.price_store import store_prices
    from kvroute.billing.pricing import GpuRateCard
    from kvroute.plugin.adapter import hybrid
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.deployments import Backend
    from kvroute.plugin.adapter.request_ids import RequestIds

    url = f"sqlite:///{tmp_path / 'billing.db'}"
    card = {"gpu_hour": "2.00 USD", "prefill_tok_s": 3000, "decode_tok_s": 1000}
    led = Ledger.open(url)
    store_prices(led, parse_price_data({"backends": [
        {"id": "gpu-1", "provider": "vllm", "rates": [{"effective_from": "2020-01-01", **card}]}]}))
    led.close()
    feed = BillingFeed(None, RequestIds())
    feed.db_url = url
    fleet = [Backend("gpu-1", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7"),
                     output_price=Decimal("8e-7")),
             Backend("gpu-2", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7"),
                     output_price=Decimal("8e-7")),
             Backend("prov", "chat", "m", "hosted", "openai_compatible", input_price=Decimal("2e-6"))]
    cards = feed.rate_cards(b.id for b in fleet if b.self_hosted)
    assert set(cards) == {"gpu-1"}
    policy = Router().set_policy("chat", "hybrid", {})
    policy.bind(FleetView(sides=lambda: hybrid.route_sides(fleet, cards)))
    expected = GpuRateCard(Decimal("2.00"), Decimal(3000), Decimal(1000)).per_token()
    assert (policy.self_rate("gpu-1").input_price, policy.self_rate("gpu-1").output_price) == expected
    assert policy.self_rate("gpu-2").input_price == Decimal("2e-7")  # no card: the model_list price
    rates = hybrid.status_of(policy, 0.0)["hybrid"]["self_hosted_rates"]
    assert rates["gpu-1"]["input"] == str(expected[0]) and "prov" not in rates
    assert [hybrid.route_kind(b) for b in fleet] == ["self_hosted", "self_hosted", "direct"]
    assert hybrid.route_kind(Backend("m", "chat", "m", "hosted", "marketplace")) == "marketplace"
    assert hybrid.route_kind(None) is None
    broken = BillingFeed(None, RequestIds())
    broken.db_url = f"sqlite:///{tmp_path / 'missing' / 'x.db'}"
    assert broken.rate_cards(["gpu-1"]) == {}  # no ledger yet: the replicas keep their model_list prices


def test_the_hybrid_decision_reads_the_price_files_route_kind_like_the_ledger(tmp_path):
    """A deployment the proxy classifies as hosted but the price file declares ``self_hosted`` (and the reverse)
    sits on the side the ledger rates it on."""
    from kvroute.billing.ledger import Ledger
    from kvroute.billing.price_file import parse_price_data
    from kvroute.billing.price_store import store_prices
    from kvroute.plugin.adapter import hybrid
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.deployments import Backend
    from kvroute.plugin.adapter.request_ids import RequestIds

    url = f"sqlite:///{tmp_path / 'billing.db'}"
    led = Ledger.open(url)
    store_prices(led, parse_price_data({"backends": [
        {"id": "own-box", "provider": "self_hosted", "route_kind": "self_hosted",
         "rates": [{"effective_from": "2020-01-01", "gpu_hour": "2.00", "prefill_tok_s": 3000, "decode_tok_s": 1000}]},
        {"id": "rented", "provider": "gpu-cloud", "route_kind": "marketplace"}]}))
    led.close()
    feed = BillingFeed(None, RequestIds())
    feed.db_url = url
    fleet = [Backend("own-box", "chat", "m", "hosted", "openai_compatible", input_price=Decimal("2e-6")),
             Backend("rented", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7")),
             Backend("gpu-3", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7"))]
    cards, declared = feed.price_view(b.id for b in fleet)
    assert set(cards) == {"own-box"} and set(declared) == {"own-box", "rented"}
    policy = Router().set_policy("chat", "hybrid", {})
    policy.bind(FleetView(sides=lambda: hybrid.route_sides(fleet, cards, declared)))
    assert not policy.is_hosted("own-box") and policy.is_hosted("rented") and not policy.is_hosted("gpu-3")
    assert policy.self_rate("own-box") is not None and policy.self_rate("rented") is None
    assert [hybrid.route_kind(b, declared.get(b.id)) for b in fleet] == ["self_hosted", "marketplace", "self_hosted"]


def test_the_ledger_route_kind_comes_from_the_deployment_unless_model_info_names_one():
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    class Rec:
        def __init__(self):
            self.events = []

        def record(self, e):
            self.events.append(e)

    rec, ids = Rec(), RequestIds()
    feed = BillingFeed(rec, ids)
    feed.kind_of = {"gpu-1": "self_hosted", "prov": "direct"}.get
    for backend, info in (("gpu-1", {"id": "gpu-1"}), ("prov", {"id": "prov"}),
                          ("gpu-1", {"id": "gpu-1", "kvroute_route_kind": "marketplace"})):
        meta: dict = {"user_api_key_alias": "acme"}
        _, attempt = ids.new_attempt(meta, "chat", backend)
        ticket = attempt.ticket
        call = {"model": "openai/m", "model_info": info, "metadata": meta}
        feed.attempt_started(attempt, call)
        feed.success({"litellm_params": {"metadata": meta, "model_info": info}, "model": "m",
                      "standard_logging_object": {"model": "m", "model_id": backend, "model_group": "chat"}},
                     None, None, None, ticket)
    assert [(e.backend_id, e.route_kind) for e in rec.events] == [
        ("gpu-1", "self_hosted"), ("prov", "direct"), ("gpu-1", "marketplace")]


def test_an_unreadable_ledger_leaves_the_model_list_prices(tmp_path, caplog):
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import RequestIds

    feed = BillingFeed(None, RequestIds())
    feed.db_url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens there
    assert feed.rate_cards(["gpu-1"]) == {}
    assert "rate cards unreadable" in caplog.text
