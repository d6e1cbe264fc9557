"""``kvroute billing ...`` commands (and ``report_app``, the ``kvroute report ...`` commands of ``report_cli``);
SQLAlchemy and friends load inside commands."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from kvroute.billing.ledger_option import DB_HELP, fail, open_ledger

billing_app = typer.Typer(no_args_is_help=True, help="Usage ledger: ingest events, load price books, close periods.")

@billing_app.command("ingest")
def ingest(file: Path = typer.Argument(..., help="JSONL file of usage events (schema: kvroute.billing.events)."),
           db: str | None = typer.Option(None, metavar="URL", help=DB_HELP),
           skip_invalid: bool = typer.Option(False, help="Insert the valid lines even when some lines are bad."),
           batch_size: int = typer.Option(5000, min=1, metavar="N", help="Events per transaction."),
           late_days: float | None = typer.Option(None, min=0.0, metavar="DAYS",
                                                  help="Refuse events older than this many days "
                                                  "(default 35, or the billing setting late_event_days)."),
           progress: bool | None = typer.Option(None, "--progress/--no-progress",
                                                help="Progress bar (default: on a terminal, file over 1 MB).")) -> None:
    """Import usage events idempotently; bad lines are listed (line, field, reason) and nothing is inserted."""
    from kvroute.billing.ingest import EventWindow, ingest_file
    from kvroute.billing.settings import BillingSettings
    from kvroute.policies.errors import InputError
    settings = BillingSettings()
    window = EventWindow(settings.late_event_days if late_days is None else late_days, settings.future_skew_s)
    if progress is None:
        progress = sys.stderr.isatty() and file.is_file() and file.stat().st_size > 1_000_000
    ledger = open_ledger(db)
    try:
        with _ingest_progress(progress) as tick:
            result = ingest_file(ledger, file, batch_size=batch_size, skip_invalid=skip_invalid, window=window,
                                 progress=tick)
    except InputError as exc:
        fail(f"error: {exc}")
    finally:
        ledger.close()
    for err in result.errors[:200]:
        typer.echo(f"{file}: {err}", err=True)
    if len(result.errors) > 200:
        typer.echo(f"... and {len(result.errors) - 200} more bad lines", err=True)
    if result.errors and not skip_invalid:
        fail(f"{len(result.errors)} bad line(s); nothing was inserted (fix them or pass --skip-invalid)")
    for backend, count in sorted(result.unpriced.items()):
        typer.echo(f"warning: {count} event(s) on backend {backend!r} have no reported cost and no rate card: "
                   "booked at cost 0 and flagged unpriced in reports (load a rate card, then kvroute billing rerate "
                   "--month YYYY-MM prices them)", err=True)
    typer.echo(f"{result.valid} valid events, {result.inserted} inserted, {result.valid - result.inserted} "
               f"already present, {len(result.errors)} skipped")


@contextlib.contextmanager
def _ingest_progress(show: bool) -> Iterator[Any]:
    """A rich progress bar on stderr fed by ``ingest_file``'s ``progress(phase, done, total)``; None when off."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    bar = Progress("[progress.description]{task.description}", BarColumn(), "{task.percentage:>3.0f}%",
                   MofNCompleteColumn(), TimeRemainingColumn(), console=Console(stderr=True))
    tasks: dict[str, Any] = {}

    def tick(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            label = "checking (bytes)" if phase == "read" else "inserting (events)"
            tasks[phase] = bar.add_task(label, total=total)
        bar.update(tasks[phase], completed=done, total=total)

    with bar:
        yield tick


def _in_file(file: Path, exc: Exception) -> str:
    """``<file>: <problem>``, naming the file once (an unreadable file's error already starts with it)."""
    text = str(exc)
    return text if text.startswith(f"{file}: ") else f"{file}: {text}"


@billing_app.command("load-prices")
def load_prices(file: Path = typer.Argument(..., help="YAML or TOML price file (backends, rates, price books)."),
                db: str | None = typer.Option(None, help=DB_HELP),
                check: bool = typer.Option(False, "--check", help="Only validate the file.")) -> None:
    """Validate and load price books and rate cards; errors name the bad rule or field."""
    from kvroute.billing.price_file import read_price_file
    from kvroute.billing.price_store import store_prices
    from kvroute.policies.errors import ConfigError
    try:
        pf = read_price_file(file)
    except ConfigError as exc:
        fail(_in_file(file, exc))
    if check:
        typer.echo(f"{file}: ok ({len(pf.backends)} backends, {len(pf.rates)} rate cards, {len(pf.books)} books)")
        return
    ledger = open_ledger(db)
    try:
        summary = store_prices(ledger, pf)
    except ConfigError as exc:
        fail(_in_file(file, exc))
    finally:
        ledger.close()
    updated = f" ({summary.backends_updated} redeclared)" if summary.backends_updated else ""
    typer.echo(f"backends +{summary.backends_added}{updated}, rate cards +{summary.rates_added}, price books "
               f"+{summary.books_added} ({summary.books_unchanged} unchanged)")


@billing_app.command("close-period")
def close_period_cmd(period: str = typer.Option(..., "--period", help="YYYY-MM"),
                     app: str | None = typer.Option(None, "--app", help="Close one app only."),
                     db: str | None = typer.Option(None, help=DB_HELP),
                     grace_hours: float | None = typer.Option(None, help="Grace window (default from settings)."),
                     force: bool = typer.Option(False, help="Close now, ignoring the grace window.")) -> None:
    """Close a period: ``closing`` during the grace window, then statements and payouts are frozen."""
    from kvroute.billing.periods import close_period
    from kvroute.billing.settings import BillingSettings
    from kvroute.policies.errors import InputError
    settings = BillingSettings()
    ledger = open_ledger(db)
    try:
        result = close_period(ledger, period, app=app, force=force,
                              grace_hours=settings.grace_hours if grace_hours is None else grace_hours)
    except InputError as exc:
        fail(f"error: {exc}")
    finally:
        ledger.close()
    if result.status == "closing":
        typer.echo(f"{period}: closing; late events still land until {result.grace_until.isoformat()} "
                   "(run again after that, or pass --force)")
    else:
        typer.echo(f"{period}: closed; {result.statements} statement(s) for {len(result.apps)} app(s)")


@billing_app.command("rerate")
def rerate_cmd(month: str = typer.Option(..., "--month", "--period", help="YYYY-MM: the month whose events "
                                         "(by when they occurred) are priced again."),
               app: str | None = typer.Option(None, "--app", help="Only this app."),
               apply: bool = typer.Option(False, "--apply", help="Write it (default: a dry run printing the diff)."),
               who: str | None = typer.Option(None, "--who", help="Recorded as the run's author (default: the "
                                              "login name)."),
               db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """Price a month's events again under the books in force: a dry-run diff, then --apply (recorded who/when;
    an open month is re-priced in place, a closed one gets adjustments on the next open statement)."""
    import getpass

    from kvroute.billing.periods import check_period
    from kvroute.billing.rerate import apply_rerate, plan_rerate, render_plan
    from kvroute.policies.errors import InputError
    try:
        check_period(month)
    except InputError as exc:
        fail(f"error: {str(exc).replace('--period', '--month')}")
    ledger = open_ledger(db, must_exist=True)
    try:
        if apply:
            result = apply_rerate(ledger, month, app, created_by=who or getpass.getuser())
            plan = result.plan
        else:
            with ledger.engine.connect() as conn:
                plan = plan_rerate(conn, ledger.catalog(refresh=True), month, app)
    except InputError as exc:
        fail(f"error: {exc}")
    finally:
        ledger.close()
    scope = f"{month}" + (f" · app {app}" if app else "")
    if not plan.lines:
        typer.echo(f"re-rate {scope}: {plan.events_checked} event(s) checked, nothing changes under the books in "
                   "force")
        return
    mode = "applied" if apply else "dry run (--apply writes it)"
    typer.echo(f"re-rate {scope}: {plan.events_changed} of {plan.events_checked} event(s) change · {mode}")
    for line in render_plan(plan):
        typer.echo(line)
    if apply:
        typer.echo(f"run {result.run_id} by {result.created_by} at {result.created_at.isoformat(timespec='seconds')}: "
                   f"{len(plan.in_place)} event(s) re-priced in place, {len(plan.adjustments)} adjustment(s) "
                   "booked for closed periods")


from kvroute.billing.deadletter_cli import dead_letter_app  # noqa: E402

billing_app.add_typer(dead_letter_app, name="dead-letter")

from kvroute.billing.report_cli import report_app  # noqa: E402

__all__ = ["billing_app", "report_app"]
