"""Why an attempt's cost was absorbed (nobody billed for it), one cause per attempt.

=================  ==========================================================================================
cause              the attempt
=================  ==========================================================================================
``hedge``          lost a hedge race: a ``cancelled`` attempt whose ``error_type`` is ``HEDGE_LOST``
``cancelled``      the client went away (status ``cancelled``)
``stream_cut``     a stream the provider cut after output went out (``raw_usage.kvroute_estimate: stream_cut``)
``failed``         any other absorbed attempt: failed, superseded, or an empty answer nobody pays for
=================  ==========================================================================================

The first row that holds wins. A new cause is a new row here and a column in the reports, nothing else.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, case

from kvroute.billing.cancels import HEDGE_LOST

CAUSES = ("failed", "stream_cut", "cancelled", "hedge")
#: The report column of each cause's absorbed cost.
COLUMNS = {cause: f"absorbed_{cause}" for cause in CAUSES}


def hedge_lost(event: Any) -> Any:
    """A SQL condition: the row is a hedge race's losing attempt."""
    return and_(event.status == "cancelled", event.error_type == HEDGE_LOST)


def lost_by_primary(event: Any) -> Any:
    """A SQL condition: a losing attempt that was the request's first route (so the hedge answered)."""
    return event.raw_usage["kvroute_hedge"].as_string() == "primary"


def cause_of(event: Any) -> Any:
    """The cause of an event row's absorbed cost, as a SQL expression (see the table above)."""
    return case(
        (and_(event.status == "cancelled", event.error_type == HEDGE_LOST), "hedge"),
        (event.status == "cancelled", "cancelled"),
        (event.raw_usage["kvroute_estimate"].as_string() == "stream_cut", "stream_cut"),
        else_="failed")
