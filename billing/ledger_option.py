"""The ``--db`` option every ledger command shares: its help text, opening the ledger it names (else the proxy's
own), and ending a command with a message and an exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

DB_HELP = ("SQLAlchemy URL or SQLite path (default: the proxy's ledger, KVROUTE_BILLING_DB, else "
           "billing.db in KVROUTE_DATA_DIR, default .kvroute).")


def open_ledger(db: str | None, must_exist: bool = False) -> Any:
    """Open the ledger ``--db`` names, else the one the proxy writes (``kvroute.billing.location``)."""
    from kvroute.billing.ledger import Ledger
    from kvroute.billing.location import location_from
    from kvroute.billing.settings import BillingSettings
    from kvroute.policies.errors import ConfigError
    url = db
    if url is None:
        try:
            url = location_from(BillingSettings()).db_url
        except ConfigError as exc:
            fail(f"error: {exc}")
        if url is None:
            fail("error: billing is off (KVROUTE_BILLING_DB=off); pass --db to name a ledger")
    if must_exist:
        from sqlalchemy.engine import make_url

        from kvroute.billing.db import database_url
        parsed = make_url(database_url(url))
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:") \
                and not Path(parsed.database).exists():
            fail(f"error: no usage ledger at {parsed.database} (set KVROUTE_DATA_DIR or KVROUTE_BILLING_DB as "
                 "the proxy has them, or pass --db)")
    return Ledger.open(url)


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` on stderr and end the command with ``code``."""
    typer.echo(message, err=True)
    raise typer.Exit(code)
