"""What a report covers: a billing month as booked, or a range of UTC days by when the attempts ran.

- ``Scope.month("2026-11")`` (``--period``): the events booked in the month -- late events of a closed month
  included, their money as the adjustment that booked them -- and every adjustment booked in it: what the
  month's statement bills.
- ``Scope.days(start, end)`` (``--from``/``--to``, inclusive, UTC): the attempts that ran on those days, each at
  its current rating (re-priced in place by ``rerate``, or corrected by the ``rerate`` adjustments of a closed
  month, which count on the attempt's own day): what happened, wherever it was billed.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from kvroute.policies.errors import InputError

PERIOD = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def check_period(value: str, where: str = "--period") -> str:
    if not isinstance(value, str) or not PERIOD.match(value):
        raise InputError(where, f"expected YYYY-MM, got {value!r}")
    return value


def parse_day(value: str, where: str) -> date:
    if isinstance(value, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        try:
            return date.fromisoformat(value)
        except ValueError:
            pass
    raise InputError(where, f"expected a date YYYY-MM-DD, got {value!r}")


def midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Scope:
    """A booked month (``period``) or the UTC days ``start``..``end`` (both inclusive); exactly one of the two."""

    period: str | None = None
    start: date | None = None
    end: date | None = None

    @classmethod
    def month(cls, period: str) -> Scope:
        return cls(period=check_period(period))

    @classmethod
    def days(cls, start: date, end: date) -> Scope:
        if end < start:
            raise InputError("--to", f"{end} is before --from {start}")
        return cls(start=start, end=end)

    @classmethod
    def month_days(cls, period: str) -> Scope:
        """Every day of ``period`` as a range of days (what ran in the month, wherever it was billed)."""
        check_period(period)
        year, month = int(period[:4]), int(period[5:])
        return cls.days(date(year, month, 1), date(year, month, calendar.monthrange(year, month)[1]))

    @classmethod
    def parse(cls, period: str | None, start: str | None, end: str | None) -> Scope:
        """``--period`` or ``--from`` + ``--to`` (one of the two, checked: errors name the option)."""
        if period is not None and (start is not None or end is not None):
            raise InputError("--period", "give either --period or --from/--to, not both")
        if period is not None:
            return cls.month(period)
        if start is None or end is None:
            raise InputError("--from" if start is None else "--to",
                             "is required (a range is --from YYYY-MM-DD --to YYYY-MM-DD), or give --period YYYY-MM")
        return cls.days(parse_day(start, "--from"), parse_day(end, "--to"))

    @classmethod
    def parse_range(cls, text: str, where: str) -> Scope:
        """``A..B`` (days ``YYYY-MM-DD``, inclusive) or one month ``YYYY-MM`` (its days)."""
        if ".." not in text:
            try:
                return cls.month_days(text)
            except InputError:
                raise InputError(where, f"expected YYYY-MM-DD..YYYY-MM-DD or YYYY-MM, got {text!r}") from None
        a, b = text.split("..", 1)
        first, last = parse_day(a, where), parse_day(b, where)
        if last < first:
            raise InputError(where, f"{text} ends before it starts")
        return cls.days(first, last)

    @property
    def is_month(self) -> bool:
        return self.period is not None

    @property
    def label(self) -> str:
        """``2026-11`` or ``2026-11-01..2026-11-07``: the ``period`` column of every row."""
        return self.period if self.period is not None else f"{self.start}..{self.end}"

    @property
    def day_count(self) -> int | None:
        return None if self.start is None or self.end is None else (self.end - self.start).days + 1

    def occurred(self, column: Any) -> list[Any]:
        """Conditions on an ``occurred_at`` column: within the days (none for a month scope)."""
        if self.start is None or self.end is None:
            return []
        return [column >= midnight(self.start), column < midnight(self.end + timedelta(days=1))]
