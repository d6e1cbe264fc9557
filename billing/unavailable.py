"""``is_unavailable``: whether a database error means the ledger cannot be reached (retry later) or that it
refused one row (dead-letter that row). SQLAlchemy is imported only when an error is classified."""

from __future__ import annotations


def is_unavailable(exc: BaseException) -> bool:
    """A connection-level failure (retry later) as opposed to a row the database refuses."""
    from sqlalchemy import exc as sa_exc
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, OSError,
                        sa_exc.TimeoutError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)
