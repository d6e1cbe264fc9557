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

#: The ``error_type`` a hedge's losing attempt is booked with (a ``cancelled`` attempt).
HEDGE_LOST = "hedge_lost"
CAUSES = ("failed", "stream_cut", "cancelled", "hedge")
#: The report column of each cause's absorbed cost.
COLUMNS = {cause: f"absorbed_{cause}" for cause in CAUSES}


def cause_of(event: Any) -> Any:
    """The cause of an event row's absorbed cost, as a SQL expression (see the table above)."""
    return case(
        (and_(event.status == "cancelled", event.error_type == HEDGE_LOST), "hedge"),
        (event.status == "cancelled", "cancelled"),
        (event.raw_usage["kvroute_estimate"].as_string() == "stream_cut", "stream_cut"),
        else_="failed")
