"""Figures read from the attempts one by one, which do not add across rows: latency quantiles and sessions.

- ``ttft_p50_ms``, ``ttft_p90_ms``, ``ttft_p99_ms``, ``duration_p50_ms``, ``duration_p90_ms``: over the final
  successful attempts that report the time (``ttft_ms``, ``duration_ms``), nearest-rank quantiles: the value at
  rank ⌈q·n⌉ of the n sorted values, always a time some attempt took (p90 of 10 values is the 9th smallest).
- ``sessions``: distinct session ids among the row's attempts; ``cost_per_session_p50``/``_p90``: the spend of each
  session (Σ provider cost of its attempts in the scope, billed and absorbed, as each is rated), nearest-rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, and_, func, or_, type_coerce

from kvroute.billing.models import Money, UsageEventRow

if TYPE_CHECKING:
    from kvroute.billing.reports.lines import Lines

E = UsageEventRow
LATENCY = {"ttft_p50_ms": ("ttft_ms", Decimal("0.5")), "ttft_p90_ms": ("ttft_ms", Decimal("0.9")),
           "ttft_p99_ms": ("ttft_ms", Decimal("0.99")), "duration_p50_ms": ("duration_ms", Decimal("0.5")),
           "duration_p90_ms": ("duration_ms", Decimal("0.9"))}
SESSION = {"cost_per_session_p50": Decimal("0.5"), "cost_per_session_p90": Decimal("0.9")}
COLUMNS = (*LATENCY, "sessions", *SESSION)


def nearest_rank(ordered: Sequence[Any], q: Decimal) -> Any:
    """The ``q`` quantile of sorted values by nearest rank (None for none): ``ordered[⌈q·n⌉ − 1]``."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def add(conn: Connection, lines: Lines, rows: dict[tuple, dict[str, Any]], row_key: Callable[[tuple], tuple]) -> None:
    """Fill the latency and session columns of ``rows`` from the scope's attempts."""
    width = lines.width()
    times: dict[tuple, dict[str, list[int]]] = defaultdict(lambda: {"ttft_ms": [], "duration_ms": []})
    query = lines.events(E.ttft_ms, E.duration_ms).where(
        E.is_final_attempt.is_(True), E.status == "success", or_(E.ttft_ms.is_not(None), E.duration_ms.is_not(None)))
    keys: dict[tuple, dict[str, list[int]]] = {}
    for r in conn.execute(query):
        key = r[:width]
        found = keys.get(key)
        if found is None:
            found = keys[key] = times[row_key(key)]
        ttft, duration = r[width], r[width + 1]
        if ttft is not None:
            found["ttft_ms"].append(ttft)
        if duration is not None:
            found["duration_ms"].append(duration)
    spend: dict[tuple, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    total = type_coerce(func.coalesce(func.sum(type_coerce(E.provider_cost, Money())), 0), Money())
    query = lines.events(E.session_id.label("session"), total.label("spend")).where(
        and_(E.session_id.is_not(None))).group_by(*lines.key_columns(), E.session_id)
    for r in conn.execute(query):
        spend[row_key(tuple(r[:width]))][r.session] += r.spend
    for rk, row in rows.items():
        found = times.get(rk, {"ttft_ms": [], "duration_ms": []})
        ordered = {k: sorted(v) for k, v in found.items()}
        for column, (source, q) in LATENCY.items():
            row[column] = nearest_rank(ordered[source], q)
        sessions = sorted(spend.get(rk, {}).values())
        row["sessions"] = len(sessions)
        for column, q in SESSION.items():
            row[column] = nearest_rank(sessions, q)
