"""``kvroute billing dead-letter list|retry``: show the events the recorder could not store, re-ingest fixed ones."""

from __future__ import annotations

import os
from pathlib import Path

import typer

dead_letter_app = typer.Typer(no_args_is_help=True, help="Events the recorder could not store (fix, then retry).")

DIR_HELP = "Data directory holding dead-letter.jsonl (default: KVROUTE_DATA_DIR, else .kvroute)."


def _dead(data_dir: Path | None):
    from kvroute.billing.deadletter import DeadLetter
    return DeadLetter(data_dir or Path(os.environ.get("KVROUTE_DATA_DIR") or ".kvroute"))


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
              db: str | None = typer.Option(None, help="SQLAlchemy URL or SQLite path (default: the data "
                                                       "directory's billing.db, or KVROUTE_BILLING_DB).")) -> None:
    """Parse and insert every entry; stored ones leave the file, the others stay with their new error (exit 1)."""
    from kvroute.billing.ledger import Ledger
    from kvroute.billing.recorder import default_paths
    dead = _dead(data_dir)
    url = db or os.environ.get("KVROUTE_BILLING_DB") or default_paths(dead.path.parent)[0]
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
