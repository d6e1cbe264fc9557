"""``kvroute billing dead-letter list|retry``: show the events the recorder could not store, re-ingest fixed ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

dead_letter_app = typer.Typer(no_args_is_help=True, help="Events the recorder could not store (fix, then retry).")

DIR_HELP = "Data directory holding dead-letter.jsonl (default: KVROUTE_DATA_DIR, else .kvroute)."


def _location(data_dir: Path | None) -> Any:
    """The proxy's ledger location (``kvroute.billing.location``), with ``--data-dir`` in place of the setting."""
    from kvroute.billing.location import ledger_location
    from kvroute.billing.settings import BillingSettings
    from kvroute.policies.errors import ConfigError
    s = BillingSettings()
    try:
        return ledger_location(data_dir or s.ledger.data_dir, s.ledger.billing_db, s.ledger.billing_spool)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _dead(data_dir: Path | None) -> Any:
    from kvroute.billing.deadletter import DeadLetter
    return DeadLetter(_location(data_dir).dead_letters)


@dead_letter_app.command("list")
def list_cmd(data_dir: Path | None = typer.Option(None, "--data-dir", help=DIR_HELP)) -> None:
    """One line per entry: index, when, source, reason and the start of the event line (edit it in place)."""
    dead = _dead(data_dir)
    entries = dead.entries()
    for e in entries:
        typer.echo(f"{e.index}\t{e.at}\t{e.source}\t{e.error[:160]}\t{e.line[:200]}")
    typer.echo(f"{len(entries)} dead-lettered event(s) in {dead.path}", err=True)


@dead_letter_app.command("retry")
def retry_cmd(data_dir: Path | None = typer.Option(None, "--data-dir", help=DIR_HELP),
              db: str | None = typer.Option(None, help="SQLAlchemy URL or SQLite path (default: KVROUTE_BILLING_DB, "
                                                       "else the data directory's billing.db).")) -> None:
    """Parse and insert every entry; stored ones leave the file, the others stay with their new error (exit 1)."""
    from kvroute.billing.deadletter import DeadLetter
    from kvroute.billing.ledger import Ledger
    where = _location(data_dir)
    dead = DeadLetter(where.dead_letters)
    url = db or where.db_url
    if url is None:
        typer.echo("error: billing is off (KVROUTE_BILLING_DB=off); pass --db to name a ledger", err=True)
        raise typer.Exit(2)
    ledger = Ledger.open(url)
    try:
        result = dead.retry(ledger.insert_events)
    finally:
        ledger.close()
    for err in result.errors[:50]:
        typer.echo(err, err=True)
    typer.echo(f"{result.inserted} stored, {result.remaining} still dead-lettered")
    if result.remaining:
        raise typer.Exit(1)
