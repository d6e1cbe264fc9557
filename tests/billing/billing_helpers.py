"""Shared builders for billing tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kvroute.billing.events import UsageEvent
from kvroute.billing.usage import TokenBuckets

PRICES = {
    "currency": "USD",
    "backends": [
        {"id": "vllm-a", "provider": "self_hosted", "served_model": "llama-8b", "route_kind": "self_hosted",
         "rates": [{"effective_from": "2026-01-01", "gpu_hour": "3.60", "tokens_per_s": 1000,
                    "cache_read_per_mtok": "0.10"}]},
        {"id": "or-claude", "provider": "openrouter", "served_model": "claude-sonnet", "route_kind": "marketplace",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "3", "cache_read_per_mtok": "0.3",
                    "cache_write_5m_per_mtok": "3.75", "cache_write_1h_per_mtok": "6", "output_per_mtok": "15"}]},
    ],
    "price_books": [
        {"version": 1, "effective_from": "2026-01-01",
         "rules": [{"name": "default", "markup_pct": "0.10"}]},
        {"app": "acme", "version": 1, "effective_from": "2026-01-01", "platform_fee_pct": "0.05",
         "rules": [
             {"name": "claude", "match": {"model": "claude-*"}, "markup_pct": "0.20",
              "surcharge_per_mtok": {"input": "0.50", "output": "1.00", "cache_read": "0"}},
             {"name": "selfhosted", "match": {"route_kind": "self_hosted"}, "fee_per_request": "0.0005",
              "min_per_request": "0.001", "bill_failed_attempts": False},
         ]},
    ],
}


def event(i: int = 0, **over: Any) -> UsageEvent:
    fields: dict[str, Any] = {
        "request_id": f"req-{i}", "app_id": "acme", "occurred_at": datetime(2026, 10, 3, 12, tzinfo=UTC),
        "served_model": "claude-sonnet", "provider": "openrouter", "backend_id": "or-claude",
        "route_kind": "marketplace", "tokens": TokenBuckets(1000, 3000, 200, 0, 400, 0),
    }
    fields.update(over)
    return UsageEvent(**fields)


def dec(s: str) -> Decimal:
    return Decimal(s)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
