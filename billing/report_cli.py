"""``kvroute report usage|margin|payouts|compare|statement|html``: the ledger as a builder reads it."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from kvroute.billing.ledger_option import DB_HELP, fail, open_ledger

report_app = typer.Typer(no_args_is_help=True, help="Usage, margin, payouts, statements and a page, per app.")

BY_HELP = ("Rows per app and up to two levels: app, day, model, backend, provider, end_user, key, session, tag "
           "(e.g. app,day).")
FROM_HELP = "First UTC day of a range (YYYY-MM-DD), with --to: what ran on those days."
TO_HELP = "Last UTC day of the range (inclusive)."
PERIOD_HELP = "A billing month YYYY-MM, as booked (what its statement bills)."


@contextlib.contextmanager
def _opened(db: str | None) -> Iterator[tuple[Any, Any]]:
    """(connection, catalog) of the ledger; a user's mistake (``InputError``) ends the command with its line."""
    from kvroute.policies.errors import InputError
    ledger = open_ledger(db, must_exist=True)
    if db is None:  # the proxy's own ledger: what its drainer holds from the journal goes in first
        from kvroute.billing.drain import catch_up
        from kvroute.billing.location import location_from
        from kvroute.billing.settings import BillingSettings

        catch_up(location_from(BillingSettings()).journal)
    try:
        with ledger.engine.connect() as conn:
            yield conn, ledger.catalog(refresh=True)
    except InputError as exc:
        fail(f"error: {exc}")
    finally:
        ledger.close()


def _checked(check: Callable[[], Any]) -> Any:
    from kvroute.policies.errors import InputError
    try:
        return check()
    except InputError as exc:
        fail(f"error: {exc}")


def _write(text: str, out: Path | None, rows: int) -> None:
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {rows} rows to {out}")


def _report(kind: str, period: str | None, start: str | None, end: str | None, app: str | None, fmt: str,
            out: Path | None, db: str | None, by: str, columns: str | None) -> None:
    from kvroute.billing import export
    from kvroute.billing.reports import Grouping, Scope, build_report
    from kvroute.billing.reports.columns import chosen_columns
    if fmt not in export.FORMATS:
        fail(f"error: --format must be one of {', '.join(export.FORMATS)}")
    if fmt == "parquet" and out is None:
        fail("error: --format parquet needs --out FILE")
    scope = _checked(lambda: Scope.parse(period, start, end))
    grouping = _checked(lambda: Grouping.parse(by))
    shown = _checked(lambda: chosen_columns(kind, grouping, columns))
    with _opened(db) as (conn, catalog):
        report = build_report(conn, catalog, kind, scope, app, grouping)
    everything = report.rows + report.totals
    unpriced = sum(t.get("unpriced_events") or 0 for t in report.totals)
    if unpriced:
        typer.echo(f"warning: {unpriced} event(s) had no reported cost and no rate card: booked at cost 0 "
                   f"(column unpriced_events; after load-prices, kvroute billing rerate --month YYYY-MM)", err=True)
    if not report.rows:
        scope_words = f"in {scope.label}" + (f" for app {app}" if app else "")
        typer.echo(f"no usage {scope_words} in this ledger", err=fmt != "table" or out is not None)
        if fmt == "table" and out is None:
            return
    if fmt == "table" and out is None:
        export.render_table(everything, shown, report.title)
        return
    show = out is not None and sys.stderr.isatty() and len(everything) > 2000
    with _progress(show, kind, len(everything)) as tick:
        if fmt == "csv":
            text = export.to_csv(everything, report.columns, tick=tick)
        elif fmt == "json":
            text = export.to_json(report.rows, report.columns, report.totals)
        elif fmt == "parquet":
            export.write_parquet(everything, report.columns, out)  # type: ignore[arg-type]
            typer.echo(f"wrote {len(everything)} rows to {out}")
            return
        else:
            buf = io.StringIO()
            export.render_table(everything, report.columns if columns is None else shown, report.title, file=buf,
                                width=240)
            text = buf.getvalue()
    _write(text, out, len(everything))


@contextlib.contextmanager
def _progress(show: bool, kind: str, total: int) -> Iterator[Callable[[], None]]:
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress
    progress = Progress(transient=True, console=Console(stderr=True))
    task = progress.add_task(f"writing {kind} report", total=total)
    with progress:
        yield lambda: progress.advance(task)


def _report_command(kind: str, doc: str) -> None:
    def command(period: str | None = typer.Option(None, "--period", help=PERIOD_HELP),
                start: str | None = typer.Option(None, "--from", help=FROM_HELP),
                end: str | None = typer.Option(None, "--to", help=TO_HELP),
                app: str | None = typer.Option(None, "--app", help="Only this app."),
                fmt: str = typer.Option("table", "--format", help="table | csv | json | parquet"),
                out: Path | None = typer.Option(None, "--out", help="Write to a file instead of stdout."),
                db: str | None = typer.Option(None, help=DB_HELP),
                by: str = typer.Option("backend", "--by", help=BY_HELP),
                columns: str | None = typer.Option(None, "--columns", help="Table columns: a comma list, or 'all' "
                                                   "(default: a set that fits a terminal; files carry every column).")
                ) -> None:
        _report(kind, period, start, end, app, fmt, out, db, by, columns)

    def payouts(period: str = typer.Option(..., "--period", help="YYYY-MM"),
                app: str | None = typer.Option(None, "--app", help="Only this app."),
                fmt: str = typer.Option("table", "--format", help="table | csv | json | parquet"),
                out: Path | None = typer.Option(None, "--out", help="Write to a file instead of stdout."),
                db: str | None = typer.Option(None, help=DB_HELP),
                columns: str | None = typer.Option(None, "--columns", help="Table columns: a comma list, or 'all'.")
                ) -> None:
        _report(kind, period, None, None, app, fmt, out, db, "app", columns)
    chosen = payouts if kind == "payouts" else command
    chosen.__doc__ = doc
    report_app.command(kind)(chosen)


_report_command("usage", "Requests, errors, tokens, spend, cache savings and latency per app (× --by levels) over a "
                         "month (--period) or days (--from/--to).")
_report_command("margin", "Usage plus billed, markup, fees, margin and payout per app (× --by levels); billed = "
                          "provider cost + markup + fees.")
_report_command("payouts", "Per-app payout = markup + fees − platform fee − payment fee, floored at 0: frozen at "
                           "period close (status pending until paid), provisional before.")


@report_app.command("compare")
def compare_cmd(before: str = typer.Option(..., "--before", help="Days before the change: YYYY-MM-DD..YYYY-MM-DD "
                                           "(inclusive, UTC) or a month YYYY-MM."),
                after: str = typer.Option(..., "--after", help="Days after the change, the same way."),
                app: str | None = typer.Option(None, "--app", help="One app (default: the totals of all apps)."),
                fmt: str = typer.Option("table", "--format", help="table | csv | json"),
                db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """Before and after a routing change: cached share, savings, TTFT, errors, cost per request and session.

    Each side is ``report usage --from --to --by app`` for --app (else the totals of all apps), with the change."""
    from kvroute.billing import export
    from kvroute.billing.reports.compare import COLUMNS, compare
    from kvroute.billing.reports.scope import Scope
    if fmt not in ("table", "csv", "json"):
        fail("error: --format must be one of table, csv, json")
    a = _checked(lambda: Scope.parse_range(before, "--before"))
    b = _checked(lambda: Scope.parse_range(after, "--after"))
    with _opened(db) as (conn, catalog):
        result = compare(conn, catalog, a, b, app)
    if fmt == "json":
        typer.echo(export.to_json(result["rows"], COLUMNS, [], meta={k: v for k, v in result.items() if k != "rows"}))
    elif fmt == "csv":
        typer.echo(export.to_csv(result["rows"], COLUMNS), nl=False)
    else:
        empty = result["no_usage"]

        def cell(side: str, r: dict[str, Any]) -> str:
            return "–" if side in empty or (side == "change" and empty) else export.cell_text(r[side], r["figure"])
        shown = [{**r, "before": cell("before", r), "after": cell("after", r), "change": cell("change", r),
                  "change_pct": "" if r["change_pct"] is None else f"{r['change_pct']:+.1f} %"} for r in result["rows"]]
        export.render_table(shown, COLUMNS, f"kvroute compare · {result['app']} · before {result['before']} · after "
                            f"{result['after']} · {result['currency'] or 'no usage'}" + "".join(
                                f" · no usage {side}" for side in empty))


@report_app.command("statement")
def statement_cmd(app: str = typer.Option(..., "--app", help="The app whose customer is billed."),
                  period: str = typer.Option(..., "--period", help="The month YYYY-MM."),
                  customer: str | None = typer.Option(None, "--customer", help="One end user of the app (the "
                                                      "request's user) instead of all its customers."),
                  currency: str | None = typer.Option(None, "--currency", help="Where the app bills in several."),
                  fmt: str = typer.Option("json", "--format", help="json | csv | html"),
                  out: Path | None = typer.Option(None, "--out", help="Write to a file instead of stdout."),
                  db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """A customer statement: lines per model × token bucket, adjustments, total; nothing internal.

    Statement number, period, customer, quantity, unit price and amount per line, adjustments with the month they
    come from. A closed month's number and total are its frozen statement's."""
    from kvroute.billing import export
    from kvroute.billing.reports.statement import CSV_COLUMNS, build_statement, statement_rows
    if fmt not in ("json", "csv", "html"):
        fail("error: --format must be one of json, csv, html")
    with _opened(db) as (conn, catalog):
        statement = build_statement(conn, catalog, app, period, customer, currency)
    if fmt == "json":
        import json
        text = json.dumps(statement.as_dict(), indent=2) + "\n"
    elif fmt == "csv":
        text = export.to_csv(statement_rows(statement), CSV_COLUMNS)
    else:
        from kvroute.billing.reports.page import render_statement
        text = render_statement(statement)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote statement {statement.number} ({statement.total} {statement.currency}) to {out}")


@report_app.command("html")
def html_cmd(out: Path = typer.Option(..., "--out", help="The HTML file to write."),
             period: str | None = typer.Option(None, "--period", help="A month YYYY-MM: its days."),
             start: str | None = typer.Option(None, "--from", help=FROM_HELP),
             end: str | None = typer.Option(None, "--to", help=TO_HELP),
             app: str | None = typer.Option(None, "--app", help="Only this app."),
             db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """One self-contained HTML page per app and day, with charts; opens from disk, fetches nothing.

    Per app: spend, billed, margin, cache savings, cached share, TTFT p50/p90, error rate, daily; the fleet's hit
    rate. --period M stands for the days of M."""
    from kvroute.billing.reports.page import page_data, render_page
    from kvroute.billing.reports.scope import Scope
    scope = _checked(lambda: Scope.month_days(period) if period is not None and start is None and end is None
                     else Scope.parse(period, start, end))
    with _opened(db) as (conn, catalog):
        data = page_data(conn, catalog, scope, app)
    out.write_text(render_page(data))
    typer.echo(f"wrote {out} ({len(data['apps'])} app(s), {scope.label})")
