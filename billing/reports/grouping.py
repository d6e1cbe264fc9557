"""``--by``: the levels a report row is grouped on beyond its app (every row is one app's: money is priced per
app), up to two of ``app, day, model, backend, provider, end_user, key, session, tag`` (``--by app,day``).

Each level adds its columns to a row: ``backend`` is served model × provider × backend × route kind (who served
it), ``model`` the served model, ``day`` the UTC day the attempt ran, ``key`` the hashed API key, ``session`` the
session the client named, ``tag`` one of the request's tags (a request with two tags counts in both rows; the
totals count it once). A value the ledger does not hold reads ``(none)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, literal_column
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import String

from kvroute.billing.models import UsageEventRow, UsageEventTagRow
from kvroute.policies.errors import InputError

E, T = UsageEventRow, UsageEventTagRow
NONE = "(none)"
_NONE_SQL = literal_column("'(none)'", String())
#: ``--by`` level -> the row columns it adds (in order).
LEVELS: dict[str, tuple[str, ...]] = {
    "app": (), "day": ("day",), "model": ("served_model",), "backend": ("served_model", "provider", "backend_id",
                                                                         "route_kind"),
    "provider": ("provider",), "end_user": ("end_user",), "key": ("api_key_hash",), "session": ("session_id",),
    "tag": ("tag",),
}
#: Columns whose values are text (left-aligned in a table).
TEXT_COLUMNS = frozenset({"app_id", "day", "served_model", "provider", "backend_id", "route_kind", "end_user",
                          "api_key_hash", "session_id", "tag", "pricing_rule", "status", "period", "currency",
                          "figure"})


class utc_day(FunctionElement):
    """``YYYY-MM-DD`` of a ``Tz`` column in UTC (SQLite keeps naive UTC text; PostgreSQL a timestamptz)."""

    type = String()
    inherit_cache = True


@compiles(utc_day, "sqlite")
def _day_sqlite(element: utc_day, compiler: Any, **kw: Any) -> str:
    return f"substr({compiler.process(element.clauses, **kw)}, 1, 10)"


@compiles(utc_day, "postgresql")
def _day_postgresql(element: utc_day, compiler: Any, **kw: Any) -> str:
    return f"to_char(({compiler.process(element.clauses, **kw)}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


@dataclass(frozen=True, slots=True)
class Grouping:
    """The ``--by`` levels of a report and the columns they add; ``Grouping()`` is one row per app."""

    levels: tuple[str, ...] = ()

    @classmethod
    def parse(cls, by: str | tuple[str, ...] | Grouping) -> Grouping:
        """``"app"``, ``"backend"``, ``"app,day"``, ``"model,day"`` ...: at most two levels, each known once."""
        if isinstance(by, Grouping):
            return by
        names = [n.strip() for n in (by.split(",") if isinstance(by, str) else by)]
        for name in names:
            if name not in LEVELS:
                raise InputError("--by", f"must be one or two of {', '.join(LEVELS)} (e.g. app,day), got {name!r}")
        if len(names) > 2 or len(set(names)) != len(names):
            raise InputError("--by", f"at most two different levels (e.g. app,day), got {by!r}")
        return cls(tuple(n for n in names if n != "app"))

    @property
    def columns(self) -> tuple[str, ...]:
        out: list[str] = []
        for level in self.levels:
            out.extend(c for c in LEVELS[level] if c not in out)
        return tuple(out)

    @property
    def by_tag(self) -> bool:
        return "tag" in self.levels

    @property
    def whole_apps(self) -> bool:
        """Whether each row is a whole app (its payout, floored, can be shown)."""
        return not self.levels

    @property
    def label(self) -> str:
        return ",".join(self.levels) or "app"


def column_sql(name: str, event: Any = E, tag: Any = T) -> Any:
    """The SQL expression of a row column on the event table (and the tag table, for ``tag``); constants inline,
    so a ``GROUP BY`` of the same expression matches its ``SELECT`` on PostgreSQL."""
    if name == "day":
        return utc_day(event.occurred_at)
    if name == "tag":
        return func.coalesce(tag.tag, _NONE_SQL)
    if name == "end_user":
        return func.coalesce(event.end_user_id, _NONE_SQL)
    if name in ("api_key_hash", "session_id"):
        return func.coalesce(getattr(event, name), _NONE_SQL)
    return getattr(event, name)


def column_expr(name: str) -> Any:
    """``column_sql`` labelled with the column's name."""
    return column_sql(name).label(name)
