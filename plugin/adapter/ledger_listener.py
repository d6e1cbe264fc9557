"""The ledger as a listener of an attempt's events: each end books what LiteLLM reported for that attempt, once
(``BillingFeed`` keeps every event idempotent and attempt-unique). Subscribed first, so the booking precedes the
routing side's release: a proxy killed between the two has lost nothing billable."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvroute.plugin.adapter.attempt_events import Ended, How

if TYPE_CHECKING:
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.request_ids import Attempt, RequestState


class Ledger:
    """Books an attempt's start and end through the feed ``feed()`` returns (None: billing is off)."""

    name = "billing"

    def __init__(self, feed: Callable[[], BillingFeed | None]) -> None:
        self.feed = feed

    def sent(self, found: tuple[RequestState, Attempt], backend: str | None, data: Mapping[str, Any]) -> None:
        feed = self.feed()
        if feed is not None:
            feed.attempt_started(found[1], data)

    def ended(self, e: Ended) -> None:
        feed, p = self.feed(), e.payload
        if feed is None:
            return
        if e.how is How.SUPERSEDED and e.found is not None:
            feed.superseded(e.found[1].ticket, e.request)
        elif p is None:  # kvroute's own ending, or a request-level event the ledger booked as such
            return
        elif e.how is How.SUCCESS:
            feed.success(p.data, p.response, p.start, p.end, found=e.found)
        elif e.how is How.FAILED:
            feed.attempt_failed(p.data, p.exception, found=e.found,
                                status=e.verdict.ledger_status if e.verdict is not None else None)
        elif e.how is How.CANCELLED:
            feed.cancelled(p.data, p.relayed, p.usage)
        elif e.how is How.HEDGE_LOST and e.found is not None:
            feed.hedge_lost(p.data, e.found[1], e.produced, primary=e.primary)
