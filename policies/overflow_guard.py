"""The overflow spend guard: a cap on the share of requests sent to hosted routes and on hosted spend per hour.

``check(now, price)`` answers before a request overflows (None, ``guard_share`` or ``guard_spend``);
``record_decision`` counts every hybrid decision (self-hosted or hosted) for the share window;
``reserve`` holds a request's predicted price until ``record_spend`` replaces it by what it really cost
(a burst of concurrent overflows cannot overshoot the cap by the prices it has not been billed yet).
Money is ``Decimal`` in one currency; spend per hour is what the last ``spend_window_s`` cost, scaled to an hour.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from decimal import Decimal

HOUR_S = 3600.0


class OverflowGuard:
    """Share of hosted decisions over ``share_window_s`` and hosted spend over ``spend_window_s``.

    ``max_share`` in [0, 1] (1 = no cap); ``max_spend_per_hour`` None = no cap. The share counts at least
    ``min_requests`` decisions, so the first request of a quiet window cannot read as a 100 % share.
    """

    def __init__(self, max_share: float = 1.0, share_window_s: float = 60.0, *, min_requests: int = 20,
                 max_spend_per_hour: Decimal | None = None, spend_window_s: float = HOUR_S,
                 currency: str = "USD", reservation_ttl_s: float = 120.0, max_reservations: int = 100_000) -> None:
        if not 0.0 <= max_share <= 1.0:
            raise ValueError("max_overflow_share must be in [0, 1]")
        for name, value in (("share_window_s", share_window_s), ("spend_window_s", spend_window_s),
                            ("reservation_ttl_s", reservation_ttl_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive")
        if max_spend_per_hour is not None and (not max_spend_per_hour.is_finite() or max_spend_per_hour < 0):
            raise ValueError("max_hosted_spend_per_hour must be a finite amount >= 0")
        self.max_share = max_share
        self.share_window_s = share_window_s
        self.min_requests = max(1, int(min_requests))
        self.max_spend_per_hour = max_spend_per_hour
        self.spend_window_s = spend_window_s
        self.currency = currency
        self.reservation_ttl_s = reservation_ttl_s
        self.max_reservations = max_reservations
        self._decisions: deque[tuple[float, bool]] = deque()
        self._hosted = 0
        self._spend: deque[tuple[float, Decimal]] = deque()
        self._spent = Decimal(0)
        self._reserved: OrderedDict[str, tuple[float, Decimal]] = OrderedDict()
        self._reserved_sum = Decimal(0)
        self.total_spent = Decimal(0)

    # --- the share ------------------------------------------------------------------------------
    def _trim_share(self, now: float) -> None:
        d = self._decisions
        start = now - self.share_window_s
        while d and d[0][0] < start:
            _, hosted = d.popleft()
            self._hosted -= hosted

    def record_decision(self, now: float, hosted: bool) -> None:
        """Count one decision (``hosted``: it went to a hosted route)."""
        self._trim_share(now)
        self._decisions.append((now, hosted))
        self._hosted += hosted

    def share(self, now: float) -> float:
        """Share of the window's decisions that went hosted (0 with none)."""
        self._trim_share(now)
        return self._hosted / len(self._decisions) if self._decisions else 0.0

    # --- the spend ------------------------------------------------------------------------------
    def _trim_spend(self, now: float) -> None:
        s = self._spend
        start = now - self.spend_window_s
        while s and s[0][0] < start:
            self._spent -= s.popleft()[1]
        r = self._reserved
        while r:
            rid, (at, amount) = next(iter(r.items()))
            if at >= now - self.reservation_ttl_s and len(r) <= self.max_reservations:
                break
            del r[rid]
            self._reserved_sum -= amount

    def reserve(self, request_id: str, now: float, amount: Decimal) -> None:
        """Hold ``amount`` (the request's predicted price) until it is billed or ``reservation_ttl_s`` passes."""
        self.release(request_id)
        self._reserved[request_id] = (now, amount)
        self._reserved_sum += amount
        self._trim_spend(now)

    def release(self, request_id: str | None) -> None:
        """Drop a reservation (the request was billed, or never went hosted)."""
        held = self._reserved.pop(request_id, None) if request_id is not None else None
        if held is not None:
            self._reserved_sum -= held[1]

    def record_spend(self, now: float, amount: Decimal, request_id: str | None = None) -> None:
        """A hosted response cost ``amount``; it replaces the request's reservation."""
        self.release(request_id)
        if amount > 0:
            self._spend.append((now, amount))
            self._spent += amount
            self.total_spent += amount
        self._trim_spend(now)

    def spent(self, now: float) -> Decimal:
        """Billed plus reserved hosted spend inside the spend window."""
        self._trim_spend(now)
        return self._spent + self._reserved_sum

    def spend_per_hour(self, now: float) -> Decimal:
        """Billed hosted spend of the window, scaled to one hour (reservations excluded)."""
        self._trim_spend(now)
        return self._spent * Decimal(str(HOUR_S)) / Decimal(str(self.spend_window_s))

    def budget(self) -> Decimal | None:
        """What the window may spend under the cap (None without a cap)."""
        if self.max_spend_per_hour is None:
            return None
        return self.max_spend_per_hour * Decimal(str(self.spend_window_s)) / Decimal(str(HOUR_S))

    # --- the answer -----------------------------------------------------------------------------
    def check(self, now: float, price: Decimal, *, share: bool = True) -> str | None:
        """None when one more request at ``price`` may overflow, else ``guard_share`` or ``guard_spend``
        (``share=False``: the spend cap only, for a failover with no replica left)."""
        if share and self.max_share < 1.0:
            self._trim_share(now)
            n = max(len(self._decisions) + 1, self.min_requests)
            if (self._hosted + 1) / n > self.max_share:
                return "guard_share"
        budget = self.budget()
        if budget is not None and self.spent(now) + price > budget:
            return "guard_spend"
        return None
