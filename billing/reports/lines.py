"""``Lines``: a report scope's usage events as SQL, the grain every report part (rows, quantiles, savings) reads."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from kvroute.billing.models import UsageEventRow, UsageEventTagRow
from kvroute.billing.reports.grouping import Grouping, column_expr
from kvroute.billing.reports.scope import Scope

E, T = UsageEventRow, UsageEventTagRow


class Lines:
    """The scope's events (and adjustments) as SQL: filters, the month a line's money is booked in, the columns.

    A *partial* is one (app, row columns, currency, month): the finest grain a report adds up at (fees need the
    app's book of the month)."""

    def __init__(self, scope: Scope, grouping: Grouping, app: str | None) -> None:
        self.scope, self.grouping, self.app = scope, grouping, app
        self.columns = grouping.columns
        self.month = E.booked_period if scope.is_month else E.period

    def event_where(self) -> list[Any]:
        where = [E.booked_period == self.scope.period] if self.scope.is_month else self.scope.occurred(E.occurred_at)
        return where + ([E.app_id == self.app] if self.app is not None else [])

    def key_columns(self) -> list[Any]:
        """app, the row columns, currency, month: the columns every partial query starts with."""
        return [E.app_id.label("app_id"), *[column_expr(c) for c in self.columns], E.currency.label("currency"),
                self.month.label("month")]

    def events(self, *columns: Any) -> Any:
        """``SELECT key columns, *columns FROM usage_event [LEFT JOIN usage_event_tag]`` over the scope."""
        query = select(*self.key_columns(), *columns).select_from(E)
        if self.grouping.by_tag:
            query = query.outerjoin(T, T.event_id == E.event_id)
        return query.where(*self.event_where())

    def width(self) -> int:
        return len(self.columns) + 3
