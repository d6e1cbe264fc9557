"""The overflow spend guard: a cap on the share of requests sent to hosted routes and on hosted spend per hour.

``admit(request_id, now, price)`` answers before a request overflows (None, ``guard_share`` or ``guard_spend``)
and, when it says None, holds the request's predicted price in the same step; ``check`` answers without holding.
``record_decision`` counts every hybrid decision (self-hosted or hosted) for the share window;
``record_spend`` replaces a request's reservation by what it really cost (a burst of concurrent overflows cannot
overshoot the cap by the prices it has not been billed yet).
Money is ``Decimal`` in one currency; spend per hour is what the last ``spend_window_s`` cost, scaled to an hour.

With a ``FleetSpend`` (several proxy instances) the spend window is the fleet's: ``admit`` is one atomic
check-and-hold on the shared window, and the share and the overflow mode count the other instances' decisions.
While the fleet cannot answer, this instance spends only its share of the cap (the window's budget divided by
the instances it last knew, at least two, its own spend in the window counted against it): the fleet as a whole
stays within the cap however long the outage lasts.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from decimal import Decimal
from typing import Protocol

HOUR_S = 3600.0


class FleetSpend(Protocol):
    """The hosted spend window and decision counts shared by every instance of a group (an adapter's job).

    Amounts are ``Decimal`` in the guard's currency. ``reserve``/``spent`` answer None when the shared
    window cannot be reached (the guard then falls back to its local share); the other calls never raise."""

    def reserve(self, request_id: str, amount: Decimal, budget: Decimal) -> bool | None:
        """Atomically: hold ``amount`` if the window's billed + held spend plus it stays within ``budget``."""

    def settle(self, request_id: str, amount: Decimal) -> None:
        """Replace the request's hold by its billed ``amount`` (kept until the shared window is back)."""

    def release(self, request_id: str) -> None:
        """Drop the request's hold."""

    def spent(self) -> tuple[Decimal, Decimal] | None:
        """(billed, held) in the shared window as last seen (never waits), or None while unreachable."""

    def instances(self) -> int:
        """Live instances last known (this one included, >= 1)."""

    def peer_decisions(self) -> tuple[int, int]:
        """The other instances' (hosted, all) decisions in their share windows."""

    def peer_over_ago(self) -> float | None:
        """Seconds since another instance last saw a ratio above ``enter_ratio`` (None: none known)."""


class OverflowGuard:
    """Share of hosted decisions over ``share_window_s`` and hosted spend over ``spend_window_s``.

    ``max_share`` in [0, 1] (1 = no cap); ``max_spend_per_hour`` None = no cap. The share counts at least
    ``min_requests`` decisions, so the first request of a quiet window cannot read as a 100 % share.
    """

    def __init__(self, max_share: float = 1.0, share_window_s: float = 60.0, *, min_requests: int = 20,
                 max_spend_per_hour: Decimal | None = None, spend_window_s: float = HOUR_S,
                 currency: str = "USD", reservation_ttl_s: float = 120.0, max_reservations: int = 100_000,
                 fleet: FleetSpend | None = None) -> None:
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
        self.fleet = fleet
        self.scope = "fleet" if fleet is not None else "local"  # "local_share" while the fleet is away
        self.last_over = -math.inf  # when this instance last saw a ratio above enter_ratio

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

    def _counts(self, now: float) -> tuple[int, int]:
        """(hosted, all) decisions in the share window, the other instances' included."""
        self._trim_share(now)
        hosted, total = self._hosted, len(self._decisions)
        if self.fleet is not None:
            ph, pn = self.fleet.peer_decisions()
            hosted, total = hosted + ph, total + pn
        return hosted, total

    def local_counts(self, now: float) -> tuple[int, int]:
        """This instance's own (hosted, all) decisions in the share window (what it publishes). Read-only: safe
        to call from another thread than the one deciding."""
        start = now - self.share_window_s
        recent = [hosted for at, hosted in list(self._decisions) if at >= start]
        return sum(recent), len(recent)

    def share(self, now: float) -> float:
        """Share of the window's decisions that went hosted (0 with none)."""
        hosted, total = self._counts(now)
        return hosted / total if total else 0.0

    # --- the overflow mode's clock --------------------------------------------------------------
    def note_over(self, now: float) -> None:
        """This instance saw a ratio above ``enter_ratio`` at ``now``."""
        self.last_over = now

    def over_at(self, now: float) -> float:
        """When any instance last saw a ratio above ``enter_ratio`` (on this instance's clock)."""
        if self.fleet is not None:
            ago = self.fleet.peer_over_ago()
            if ago is not None:
                return max(self.last_over, now - ago)
        return self.last_over

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
        """Hold ``amount`` (the request's predicted price) locally until it is billed or ``reservation_ttl_s``
        passes (``admit`` holds on the fleet's window too)."""
        self._release_local(request_id)
        self._reserved[request_id] = (now, amount)
        self._reserved_sum += amount
        self._trim_spend(now)

    def _release_local(self, request_id: str | None) -> None:
        held = self._reserved.pop(request_id, None) if request_id is not None else None
        if held is not None:
            self._reserved_sum -= held[1]

    def release(self, request_id: str | None) -> None:
        """Drop a reservation (the request was billed, or never went hosted)."""
        held = request_id is not None and request_id in self._reserved
        self._release_local(request_id)
        if held and self.fleet is not None:
            self.fleet.release(request_id)  # type: ignore[arg-type]

    def record_spend(self, now: float, amount: Decimal, request_id: str | None = None) -> None:
        """A hosted response cost ``amount``; it replaces the request's reservation."""
        self._release_local(request_id)
        if amount > 0:
            self._spend.append((now, amount))
            self._spent += amount
            self.total_spent += amount
        if self.fleet is not None and request_id is not None:
            self.fleet.settle(request_id, amount)
        self._trim_spend(now)

    def local_spent(self, now: float) -> Decimal:
        """This instance's billed plus reserved hosted spend inside the spend window."""
        self._trim_spend(now)
        return self._spent + self._reserved_sum

    def spent(self, now: float) -> Decimal:
        """Billed plus reserved hosted spend inside the spend window (the fleet's when it answers)."""
        shared = self.fleet.spent() if self.fleet is not None else None
        if shared is not None:
            return shared[0] + shared[1]
        return self.local_spent(now)

    def spend_per_hour(self, now: float) -> Decimal:
        """Billed hosted spend of the window (the fleet's when it answers), scaled to one hour."""
        shared = self.fleet.spent() if self.fleet is not None else None
        if shared is not None:
            billed = shared[0]
        else:
            self._trim_spend(now)
            billed = self._spent
        return billed * Decimal(str(HOUR_S)) / Decimal(str(self.spend_window_s))

    def budget(self) -> Decimal | None:
        """What the window may spend under the cap (None without a cap)."""
        if self.max_spend_per_hour is None:
            return None
        return self.max_spend_per_hour * Decimal(str(self.spend_window_s)) / Decimal(str(HOUR_S))

    def local_budget(self) -> Decimal | None:
        """This instance's share of the window's budget while the fleet is away: budget / instances known, and
        never the whole budget (an instance that has not seen the others yet counts itself as one of two)."""
        budget = self.budget()
        if budget is None or self.fleet is None:
            return budget
        return budget / Decimal(max(2, self.fleet.instances()))

    # --- the answer -----------------------------------------------------------------------------
    def _share_blocks(self, now: float) -> bool:
        if self.max_share >= 1.0:
            return False
        hosted, total = self._counts(now)
        return (hosted + 1) / max(total + 1, self.min_requests) > self.max_share

    def check(self, now: float, price: Decimal, *, share: bool = True) -> str | None:
        """None when one more request at ``price`` may overflow, else ``guard_share`` or ``guard_spend``
        (``share=False``: the spend cap only, for a failover with no replica left). Holds nothing."""
        if share and self._share_blocks(now):
            return "guard_share"
        budget = self.budget()
        if budget is None:
            return None
        shared = self.fleet.spent() if self.fleet is not None else None
        if shared is not None:
            return "guard_spend" if shared[0] + shared[1] + price > budget else None
        limit = self.local_budget()
        return "guard_spend" if limit is not None and self.local_spent(now) + price > limit else None

    def admit(self, request_id: str | None, now: float, price: Decimal, *, share: bool = True) -> str | None:
        """``check`` and, when it passes, hold ``price`` for ``request_id`` in one step: on the fleet's window
        atomically (no race between instances can overrun it), else within this instance's local share."""
        if request_id is None:
            return self.check(now, price, share=share)
        if share and self._share_blocks(now):
            return "guard_share"
        budget = self.budget()
        if budget is not None and self.fleet is not None:
            verdict = self.fleet.reserve(request_id, price, budget)
            if verdict is not None:
                self.scope = "fleet"
                if not verdict:
                    return "guard_spend"
                self.reserve(request_id, now, price)
                return None
            self.scope = "local_share"
        limit = self.local_budget()
        if limit is not None and self.local_spent(now) + price > limit:
            return "guard_spend"
        self.reserve(request_id, now, price)
        return None
