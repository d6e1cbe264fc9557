"""A cancelled call's usage per provider mode, and whether the app pays for it (``bill_cancelled``)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from kvroute.billing.cancels import cancel_billing_for, cancelled_usage
from kvroute.billing.events import UsageEvent
from kvroute.billing.price_file import book_hash, parse_price_data
from kvroute.billing.pricing import CostRate, PriceBook, PriceRule, rate_event
from kvroute.billing.usage import normalize_usage
from kvroute.policies.errors import ConfigError, InputError

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def test_each_mode_books_the_tokens_its_provider_bills():
    relayed = normalize_usage(cancelled_usage("relayed", prompt_tokens=200, cached_tokens=50, relayed=3,
                                              max_tokens=40))
    assert (relayed.input_uncached, relayed.cache_read, relayed.output) == (150, 50, 3)
    full = normalize_usage(cancelled_usage("full", prompt_tokens=200, relayed=3, max_tokens=40))
    assert (full.input_uncached, full.output) == (200, 40)  # it kept generating: the answer's bound
    assert normalize_usage(cancelled_usage("full", prompt_tokens=200, relayed=3)).output == 3  # no bound known
    none = cancelled_usage("none", prompt_tokens=200, relayed=3)
    assert normalize_usage(none).prompt_total + normalize_usage(none).output == 0
    assert (none["kvroute_prompt_observed"], none["kvroute_relayed_output"]) == (200, 3)  # what was seen stays


def test_known_providers_have_their_mode_and_a_declaration_wins():
    assert cancel_billing_for("bedrock") == "full"
    assert cancel_billing_for("bedrock/anthropic.claude-3") == "full"
    assert cancel_billing_for("anthropic") == "relayed"
    assert cancel_billing_for("some-new-provider") == "relayed"
    assert cancel_billing_for("anthropic", "none") == "none"
    with pytest.raises(InputError):
        cancel_billing_for("anthropic", "half")


def event(status: str, *, final: bool = True) -> UsageEvent:
    tokens = normalize_usage({"prompt_tokens": 1000, "completion_tokens": 10})
    return UsageEvent("r1", "acme", T0, "m", "openai", "b", tokens, status=status, is_final=final)


RATE = CostRate("b", T0, input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))


def test_a_cancelled_request_is_billed_like_an_answer_unless_the_rule_absorbs_it():
    cost = Decimal("0.00102")  # 1000 × 1 / 1e6 + 10 × 2 / 1e6
    book = PriceBook("acme", 1, T0, rules=(PriceRule("r", 0, markup_pct=Decimal("0.5")),))
    billed = rate_event(event("cancelled"), RATE, book)
    assert (billed.provider_cost, billed.billed_amount, billed.absorbed_cost) == (cost, cost * Decimal("1.5"), 0)
    assert rate_event(event("cancelled"), RATE, None).billed_amount == cost  # no book: at cost, like an answer
    absorbing = PriceBook("acme", 1, T0, rules=(PriceRule("r", 0, markup_pct=Decimal("0.5"), bill_cancelled=False),))
    absorbed = rate_event(event("cancelled"), RATE, absorbing)
    assert (absorbed.billed_amount, absorbed.absorbed_cost) == (0, cost)
    # a cancelled attempt that did not end the request (a hedge's loser) is a failed attempt: absorbed by default
    assert rate_event(event("cancelled", final=False), RATE, book).billed_amount == 0


def test_the_price_file_declares_cancel_billing_per_provider_or_backend():
    pf = parse_price_data({
        "cancel_billing": {"bedrock": "full", "openai": "none"},
        "backends": [{"id": "b1", "provider": "bedrock"}, {"id": "b2", "provider": "openai"},
                     {"id": "b3", "provider": "bedrock", "cancel_billing": "relayed"},
                     {"id": "b4", "provider": "anthropic"}],
        "price_books": [{"version": 1, "effective_from": "2026-12-01",
                         "rules": [{"name": "all", "bill_cancelled": False}]}]})
    assert {b.backend_id: b.cancel_billing for b in pf.backends} == {"b1": "full", "b2": "none", "b3": "relayed",
                                                                   "b4": None}
    assert pf.books[0].rules[0].bill_cancelled is False
    with pytest.raises(ConfigError, match="cancel_billing"):
        parse_price_data({"backends": [{"id": "b", "provider": "x", "cancel_billing": "most"}]})
    with pytest.raises(ConfigError, match="bill_cancelled"):
        parse_price_data({"price_books": [{"version": 1, "effective_from": "2026-12-01",
                                           "rules": [{"name": "all", "bill_cancelled": "yes"}]}]})


def test_a_book_stored_before_the_flag_existed_keeps_its_hash():
    rule = PriceRule("all", 0, markup_pct=Decimal("0.2"))
    book = PriceBook(None, 1, T0, rules=(rule,))
    absorbing = PriceBook(None, 1, T0, rules=(PriceRule("all", 0, markup_pct=Decimal("0.2"), bill_cancelled=False),))
    # the hash the ledger stored for this book before ``bill_cancelled`` existed: reloading it must not conflict
    assert book_hash(book) == "d049d37e0781e47845270695dac8802200185579b55db7f0833f9b857250a3da"
    assert book_hash(book) != book_hash(absorbing)


def test_a_hedges_losing_attempt_is_absorbed_unless_the_rule_passes_it_on():
    loser = UsageEvent("r1", "acme", T0, "m", "openai", "b", normalize_usage({"prompt_tokens": 1000}),
                       status="cancelled", is_final=False, error_type="hedge_lost")
    book = PriceBook("acme", 1, T0, rules=(PriceRule("r", 0, markup_pct=Decimal("0.5")),))
    assert rate_event(loser, RATE, book).absorbed_cost == Decimal("0.001")
    passing = PriceBook("acme", 1, T0, rules=(PriceRule("r", 0, markup_pct=Decimal("0.5"), bill_hedge_lost=True),))
    assert rate_event(loser, RATE, passing).billed_amount == Decimal("0.0015")
