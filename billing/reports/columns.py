"""The columns of each report kind (csv / json / parquet carry them all) and the few a terminal table shows."""

from __future__ import annotations

from kvroute.billing.reports import attempts, savings
from kvroute.billing.reports.grouping import Grouping
from kvroute.billing.reports.rows import ABSORBED, COUNTS, FAILED, SPLIT, TOKENS
from kvroute.policies.errors import InputError

_REQUESTS = tuple(c for c in COUNTS if c not in FAILED)
_LATENCY = tuple(attempts.LATENCY)


def usage_columns(by: str | Grouping = "backend") -> tuple[str, ...]:
    g = Grouping.parse(by)
    return ("period", "app_id", *g.columns, *_REQUESTS[:3], "error_rate", *FAILED, *_REQUESTS[3:], "sessions",
            *TOKENS, "cache_hit_ratio", "provider_cost", "absorbed_cost", *ABSORBED, "hedge_cost", *SPLIT, "spend",
            "cost_per_request", "cost_per_session_p50", "cost_per_session_p90", *savings.COLUMNS, *_LATENCY,
            "adjustments", "currency")


def margin_columns(by: str | Grouping = "backend") -> tuple[str, ...]:
    return (*usage_columns(by)[:-2], "pricing_rule", "markup_amount", "fee_amount", "billed_amount", "platform_fee",
            "payment_fee", "margin_amount", "margin_pct", "payout_share", "payout_amount", "adjustments", "currency")


def payout_columns(by: str | Grouping = "app") -> tuple[str, ...]:
    return PAYOUT_COLUMNS


USAGE_COLUMNS = usage_columns()
MARGIN_COLUMNS = margin_columns()
PAYOUT_COLUMNS = ("period", "app_id", "requests_total", "billed_amount", "provider_cost", "absorbed_cost",
                  "markup_amount", "fee_amount", "platform_fee", "payment_fee", "adjustments", "payout_amount",
                  "status", "currency")
KINDS = {"usage": usage_columns, "margin": margin_columns, "payouts": payout_columns}


def table_columns(kind: str, by: str | Grouping = "backend") -> tuple[str, ...]:
    """The columns a terminal table shows by default (about 130 characters wide with ``--by app``)."""
    g = Grouping.parse(by)
    dims = tuple(c for c in g.columns if c != "route_kind" and not (c == "provider" and "backend" in g.levels))
    if kind == "usage":
        return ("app_id", *dims, "requests_total", "error_rate", "cache_hit_ratio", "provider_cost", "absorbed_cost",
                "cache_savings", "ttft_p50_ms", "ttft_p90_ms", "currency")
    if kind == "margin":
        return ("app_id", *dims, "requests_total", "provider_cost", "absorbed_cost", "billed_amount", "margin_amount",
                "margin_pct", "payout_amount" if g.whole_apps else "payout_share", "cache_savings", "currency")
    return ("app_id", "requests_total", "billed_amount", "markup_amount", "fee_amount", "platform_fee",
            "payment_fee", "payout_amount", "status", "currency")


def chosen_columns(kind: str, by: str | Grouping, wanted: str | None) -> tuple[str, ...]:
    """``--columns``: the default table set (None), ``all``, or a comma list of the kind's columns (checked)."""
    if wanted is None:
        return table_columns(kind, by)
    every = KINDS[kind](by)
    if wanted.strip() == "all":
        return every
    names = tuple(n.strip() for n in wanted.split(",") if n.strip())
    unknown = [n for n in names if n not in every]
    if unknown or not names:
        raise InputError("--columns", f"unknown column {unknown[0] if unknown else wanted!r} (this report has: "
                                      f"{', '.join(every)}; or 'all')")
    return names
