"""What cached prompt tokens saved, priced by the rate card each attempt was rated with (the one in force at it).

Per attempt: ``cache_savings = cache_read × (input_per_mtok − cache_read_per_mtok) / 1e6`` (a self-hosted GPU
card prices input by GPU time and a cache read at 0 by default: the prefill that did not run);
``cache_write_premium = (cache_write_5m × (cache_write_5m_per_mtok − input_per_mtok) + cache_write_1h ×
(cache_write_1h_per_mtok − input_per_mtok)) / 1e6`` (what writing the cache cost above uncached input);
``cache_savings_net = cache_savings − cache_write_premium``. A GPU card's ``prefill_tok_s`` also gives
``prefill_seconds_saved = cache_read / prefill_tok_s`` (replica-seconds of prefill that did not run).

An attempt without a card in its row's currency cannot be priced: its cache tokens count in
``unpriced_cache_tokens``, and a row none of whose cache reads (or writes) could be priced shows
``cache_savings`` (``cache_write_premium``) as None -- unpriced, never 0.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, or_

from kvroute.billing.catalog import Catalog
from kvroute.billing.models import UsageEventRow
from kvroute.billing.money import MILLION, ZERO, fix

if TYPE_CHECKING:
    from kvroute.billing.reports.lines import Lines

E = UsageEventRow
COLUMNS = ("cache_savings", "cache_write_premium", "cache_savings_net", "unpriced_cache_tokens",
           "prefill_seconds_saved")


def add(conn: Connection, catalog: Catalog, lines: Lines, rows: dict[tuple, dict[str, Any]],
        row_key: Callable[[tuple], tuple]) -> None:
    """Fill the savings columns of ``rows`` from the scope's attempts that read or wrote the cache."""
    acc = {rk: {"savings": ZERO, "premium": ZERO, "priced_read": 0, "priced_write": 0, "seconds": None,
                "unpriced": 0} for rk in rows}
    reads, w5, w1 = (func.coalesce(func.sum(c), 0) for c in (E.cache_read_tokens, E.cache_write_5m_tokens,
                                                             E.cache_write_1h_tokens))
    query = lines.events(E.cost_rate_id.label("rate_id"), reads.label("reads"), w5.label("w5"), w1.label("w1")).where(
        or_(E.cache_read_tokens > 0, E.cache_write_5m_tokens > 0, E.cache_write_1h_tokens > 0)).group_by(
        *lines.key_columns(), E.cost_rate_id)
    for r in conn.execute(query):
        a = acc[row_key(tuple(r[:lines.width()]))]
        reads, w5, w1 = int(r.reads), int(r.w5), int(r.w1)  # PostgreSQL sums bigints as numeric
        card = catalog.rates_by_id.get(r.rate_id) if r.rate_id is not None else None
        if card is None or card.currency != r.currency:
            a["unpriced"] += reads + w5 + w1
            continue
        a["savings"] += reads * (card.input_per_mtok - card.cache_read_per_mtok) / MILLION
        a["premium"] += (w5 * (card.cache_write_5m_per_mtok - card.input_per_mtok)
                         + w1 * (card.cache_write_1h_per_mtok - card.input_per_mtok)) / MILLION
        a["priced_read"] += reads
        a["priced_write"] += w5 + w1
        if card.prefill_tok_s:
            a["seconds"] = (a["seconds"] or ZERO) + Decimal(reads) / card.prefill_tok_s
    for rk, row in rows.items():
        a = acc[rk]
        writes = row["cache_write_5m_tokens"] + row["cache_write_1h_tokens"]
        saved = None if row["cache_read_tokens"] and not a["priced_read"] else fix(a["savings"])
        premium = None if writes and not a["priced_write"] else fix(a["premium"])
        row["cache_savings"], row["cache_write_premium"] = saved, premium
        row["cache_savings_net"] = None if saved is None or premium is None else saved - premium
        row["unpriced_cache_tokens"] = a["unpriced"]
        row["prefill_seconds_saved"] = None if a["seconds"] is None else round(float(a["seconds"]), 3)
