"""An empty completion follows ``bill_zero_completion`` whether or not LiteLLM retried it."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from billing_helpers import event

from kvroute.billing.pricing import PriceBook, PriceRule, rate_event

T0 = datetime(2026, 1, 1, tzinfo=UTC)
COST = Decimal("0.0034")


def _billed(final: bool, **rule: bool) -> Decimal:
    e = event(provider_cost=COST, status="zero_completion", is_final=final)
    return rate_event(e, None, PriceBook("acme", 1, T0, rules=(PriceRule("r", 0, **rule),))).billed_amount


@pytest.mark.parametrize("final", [True, False])
def test_an_empty_completion_is_not_billed_by_default_even_when_retried(final: bool) -> None:
    assert _billed(final) == 0
    assert _billed(final, bill_failed_attempts=True) == 0  # a retried empty answer is still an empty answer


def test_bill_zero_completion_bills_it() -> None:
    assert _billed(True, bill_zero_completion=True) == COST
    # a retried one is also a failed attempt: billed only when the rule bills both
    assert _billed(False, bill_zero_completion=True) == 0
    assert _billed(False, bill_zero_completion=True, bill_failed_attempts=True) == COST
