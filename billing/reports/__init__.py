"""``kvroute report``: usage, margin and payout rows over a month or a range of days, by app and ``--by`` levels.

``build_report`` gives a report's rows and totals; ``usage_report``/``margin_report``/``payout_report`` its rows of
one kind. Statements, the before/after comparison and the HTML page build on them (``statement``, ``compare``,
``page``).
"""

from kvroute.billing.reports.columns import (
    MARGIN_COLUMNS,
    PAYOUT_COLUMNS,
    USAGE_COLUMNS,
    margin_columns,
    payout_columns,
    table_columns,
    usage_columns,
)
from kvroute.billing.reports.grouping import Grouping
from kvroute.billing.reports.kinds import (
    Report,
    build_report,
    check_by,
    margin_report,
    payout_report,
    usage_report,
)
from kvroute.billing.reports.rows import _msum, build_rows, period_start, totals
from kvroute.billing.reports.scope import Scope

__all__ = ["MARGIN_COLUMNS", "PAYOUT_COLUMNS", "USAGE_COLUMNS", "Grouping", "Report", "Scope", "_msum",
           "build_report", "build_rows", "check_by", "margin_columns", "margin_report",
           "payout_columns", "payout_report", "period_start", "table_columns", "totals", "usage_columns",
           "usage_report"]
