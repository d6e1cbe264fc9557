"""The builder's views on an independent ledger (``independent_ledger``: ~3,000 attempts over October and November
2026, four apps, fourteen usage shapes), loaded and read through the real CLI: cache savings against an independent
rating, latency quantiles against the stored attempts, day ranges, sessions, tags, errors, absorbed cost by cause,
statements that add up and show nothing internal, before/after, and the page in a real headless Chromium."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
from collections import defaultdict
from datetime import UTC, date, datetime
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from independent_ledger import APPS, IndependentLedger, card_at, generate
from sqlalchemy import select
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.events import event_from_json
from kvroute.billing.ingest import parse_line
from kvroute.billing.ledger import Ledger
from kvroute.billing.models import UsageEventRow

runner = CliRunner()
TOLERANCE = Decimal("1e-6")
CENT = Decimal("0.01")


def cli(app: Any, *args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def report(db: str, *args: str) -> dict[str, Any]:
    r = runner.invoke(report_app, [*args, "--format", "json", "--db", db])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def load(db: str, folder: Path, ledger: IndependentLedger) -> None:
    """load-prices, ingest, close October (the CLI), then the late October requests as they arrive on 20 November
    (the ledger books them into the month open then: November, whatever today's date)."""
    prices, events, late = ledger.write(folder)
    cli(billing_app, "load-prices", str(prices), "--db", db)
    assert f"{len(ledger.attempts)} inserted" in cli(billing_app, "ingest", str(events), "--db", db, "--late-days",
                                                     "3650")
    assert "closed" in cli(billing_app, "close-period", "--period", "2026-10", "--db", db, "--force")
    arrived = Ledger.open(db, clock=lambda: datetime(2026, 11, 20, tzinfo=UTC))
    try:
        lines = [event_from_json(parse_line(raw)) for raw in late.read_bytes().splitlines()]
        assert arrived.insert_events(lines) == len(ledger.late)
    finally:
        arrived.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, IndependentLedger, Path]:
    folder = tmp_path_factory.mktemp("independent")
    db = f"sqlite:///{folder / 'ledger.db'}"
    ledger = generate()
    load(db, folder, ledger)
    return db, ledger, folder


def by(rows: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


def test_the_generated_ledger_is_what_the_issue_asks_for(built) -> None:  # type: ignore[no-untyped-def]
    _, ledger, _ = built
    attempts = ledger.attempts + ledger.late
    assert 2900 <= len(attempts) <= 3200
    assert {a.app for a in attempts} == set(APPS)
    shapes = {a.line.get("raw_usage", {}).get("kvroute_estimate") or _shape_of(a.line) for a in attempts}
    assert len({s for s in shapes if s.startswith("shape:")}) == 14
    assert {a.at.strftime("%Y-%m") for a in attempts} == {"2026-10", "2026-11"}


def _shape_of(line: dict[str, Any]) -> str:
    raw = line.get("raw_usage")
    if raw is None:
        return "shape:buckets" if line["status"] == "success" else "other"
    keys = set(raw) | {f"{k}.{d}" for k, v in raw.items() if isinstance(v, dict) for d in v}
    return "shape:" + ",".join(sorted(keys))


def test_every_apps_cache_savings_equals_an_independent_rating(built) -> None:  # type: ignore[no-untyped-def]
    """Per app, over the booked months and over the whole range: cache reads × (uncached − cache-read price) of the
    card in force at each attempt (a GPU card's and a mid-month card change included); unpriced tokens counted."""
    db, ledger, _ = built
    cases = {
        ("--period", "2026-10"): ledger.in_month(ledger.attempts, "2026-10"),
        ("--period", "2026-11"): ledger.in_month(ledger.attempts, "2026-11") + ledger.late,  # late ones booked here
        ("--from", "2026-10-01", "--to", "2026-11-30"): ledger.attempts + ledger.late,
    }
    worst = Decimal(0)
    for args, attempts in cases.items():
        data = report(db, "usage", *args, "--by", "app")
        expected, unpriced = ledger.cache_savings(attempts), ledger.unpriced_reads(attempts)
        rows = by(data["rows"], "app_id")
        assert set(rows) == set(APPS)
        for app, row in rows.items():
            diff = abs(Decimal(row["cache_savings"]) - expected[app])
            worst = max(worst, diff)
            assert diff <= TOLERANCE, (args, app, row["cache_savings"], expected[app])
            assert row["unpriced_cache_tokens"] == unpriced.get(app, 0) > 0, (args, app)
            net = Decimal(row["cache_savings"]) - Decimal(row["cache_write_premium"])
            assert Decimal(row["cache_savings_net"]) == net
        assert abs(Decimal(data["totals"][0]["cache_savings"]) - sum(expected.values())) <= TOLERANCE
    print(f"\ncache_savings: worst difference from the independent rating {worst}")


def test_self_hosted_rows_show_the_prefill_seconds_saved(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    rows = by(report(db, "usage", "--from", "2026-10-01", "--to", "2026-11-30", "--by", "backend")["rows"],
              "app_id", "backend_id")
    seconds: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for a in ledger.attempts + ledger.late:
        card = card_at(a.backend, a.at)
        if card is not None and card["prefill_tok_s"] and a.tokens.read:
            seconds[(a.app, a.backend)] += Decimal(a.tokens.read) / card["prefill_tok_s"]
    assert {k for k, r in rows.items() if r["prefill_seconds_saved"] is not None} == set(seconds)
    for key, want in seconds.items():
        assert abs(Decimal(str(rows[key]["prefill_seconds_saved"])) - want) <= Decimal("0.001"), key
    mystery = [r for (_, b), r in rows.items() if b == "mystery"]
    assert mystery and all(r["cache_savings"] is None and r["unpriced_cache_tokens"] > 0 for r in mystery)


def test_ttft_p90_of_every_app_lies_within_the_stored_attempts_quantile(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    data = report(db, "usage", "--period", "2026-11", "--by", "app")
    engine = Ledger.open(db)
    try:
        with engine.engine.connect() as conn:
            stored = defaultdict(list)
            for app, ttft in conn.execute(select(UsageEventRow.app_id, UsageEventRow.ttft_ms).where(
                    UsageEventRow.booked_period == "2026-11", UsageEventRow.is_final_attempt.is_(True),
                    UsageEventRow.status == "success", UsageEventRow.ttft_ms.is_not(None))):
                stored[app].append(ttft)
    finally:
        engine.close()
    generated = defaultdict(list)
    for a in ledger.in_month(ledger.attempts, "2026-11") + ledger.late:
        if a.final and a.status == "success" and a.ttft_ms is not None:
            generated[a.app].append(a.ttft_ms)
    for row in data["rows"]:
        values = sorted(stored[row["app_id"]])
        assert values == sorted(generated[row["app_id"]])
        n = len(values)
        for column, q in (("ttft_p50_ms", 0.5), ("ttft_p90_ms", 0.9), ("ttft_p99_ms", 0.99)):
            got = row[column]
            assert got in values  # a time some attempt took
            assert sum(v <= got for v in values) >= q * n > sum(v < got for v in values), (row["app_id"], column)
        assert row["ttft_p90_ms"] == values[math.ceil(Decimal("0.9") * n) - 1]
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert row["duration_p50_ms"] <= row["duration_p90_ms"]


def test_a_seven_day_range_by_day_counts_exactly_the_final_attempts_in_it(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    first, last = date(2026, 10, 27), date(2026, 11, 2)  # across the month end, late arrivals included
    data = report(db, "usage", "--from", str(first), "--to", str(last), "--by", "app,day")
    got = {(r["app_id"], r["day"]): r["requests_total"] for r in data["rows"]}
    want = ledger.final_per_day(ledger.attempts + ledger.late, first, last)
    assert got == want
    assert data["totals"][0]["requests_total"] == sum(want.values())
    assert {r["period"] for r in data["rows"]} == {"2026-10-27..2026-11-02"}
    assert min(d for _, d in got) == str(first) and max(d for _, d in got) == str(last)


def test_errors_failures_by_status_and_absorbed_cost_by_cause(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    data = report(db, "usage", "--from", "2026-10-01", "--to", "2026-11-30", "--by", "app")
    attempts = ledger.attempts + ledger.late
    for app, row in by(data["rows"], "app_id").items():
        mine = [a for a in attempts if a.app == app]
        final = [a for a in mine if a.final]
        failed = [a for a in final if a.status != "success"]
        assert row["requests_total"] == len(final) and row["requests_failed"] == len(failed)
        assert row["error_rate"] == round(len(failed) / len(final), 4)
        for status in ("provider_failure", "capacity", "cancelled", "zero_completion"):
            assert row[f"failed_{status}"] == sum(a.status == status for a in mine), (app, status)
        causes = {c: Decimal(row[f"absorbed_{c}"]) for c in ("failed", "stream_cut", "cancelled", "hedge")}
        assert sum(causes.values()) == Decimal(row["absorbed_cost"])
        cut = sum((ledger.spend(a) for a in mine if a.line.get("raw_usage", {}).get("kvroute_estimate")), Decimal(0))
        hedge = sum((ledger.spend(a) for a in mine if a.line.get("error_type") == "hedge_lost"), Decimal(0))
        cancelled = sum((ledger.spend(a) for a in mine if a.status == "cancelled"  # billed unless the book absorbs
                         and a.line.get("error_type") != "hedge_lost"
                         and (not a.final or ledger.absorbs_cancelled(app))), Decimal(0))
        assert (causes["stream_cut"], causes["hedge"], causes["cancelled"]) == (cut, hedge, cancelled), app
        losers = [a for a in mine if a.line.get("error_type") == "hedge_lost"]
        assert row["hedged_requests"] == len(losers) and Decimal(row["hedge_cost"]) == hedge, app
        assert row["hedge_wins"] == sum((a.line.get("raw_usage") or {}).get("kvroute_hedge") == "primary"
                                        for a in losers), app
        spend = sum((ledger.spend(a) for a in mine), Decimal(0))
        assert Decimal(row["spend"]) == spend, app  # every attempt's cost, as the ledger rated it
        assert Decimal(row["cost_per_request"]) == (spend / len(final)).quantize(Decimal("1e-10"))


def test_sessions_and_cost_per_session(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    data = report(db, "usage", "--from", "2026-11-01", "--to", "2026-11-30", "--by", "app")
    per_session: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for a in ledger.in_month(ledger.attempts, "2026-11"):
        if "session_id" in a.line:
            per_session[a.app][a.line["session_id"]] += ledger.spend(a)
    for app, row in by(data["rows"], "app_id").items():
        spends = sorted(per_session[app].values())
        assert row["sessions"] == len(spends)
        for column, q in (("cost_per_session_p50", Decimal("0.5")), ("cost_per_session_p90", Decimal("0.9"))):
            assert Decimal(row[column]) == spends[math.ceil(q * len(spends)) - 1], (app, column)
    sessions = report(db, "usage", "--from", "2026-11-01", "--to", "2026-11-30", "--by", "app,session")
    named = [r for r in sessions["rows"] if r["session_id"] != "(none)"]
    assert {(r["app_id"], r["session_id"]) for r in named} == {(a, s) for a, d in per_session.items() for s in d}
    assert all(r["sessions"] == 1 for r in named)


def test_tag_rows_count_a_request_in_each_tag_and_the_totals_once(built) -> None:  # type: ignore[no-untyped-def]
    db, ledger, _ = built
    data = report(db, "usage", "--period", "2026-10", "--by", "tag")
    attempts = ledger.in_month(ledger.attempts, "2026-10")
    want: dict[tuple[str, str], int] = defaultdict(int)
    for a in attempts:
        if a.final:
            for tag in a.line.get("tags") or ["(none)"]:
                want[(a.app, tag)] += 1
    assert {(r["app_id"], r["tag"]): r["requests_total"] for r in data["rows"]} == want
    assert data["totals"][0]["requests_total"] == sum(a.final for a in attempts)


def _internal(value: Any) -> list[str]:
    words = ("provider_cost", "cost", "margin", "payout", "markup", "platform", "absorbed", "payment_fee")
    if isinstance(value, dict):
        return [k for k in value if any(w in k for w in words)] + [x for v in value.values() for x in _internal(v)]
    if isinstance(value, list):
        return [x for v in value for x in _internal(v)]
    return []


def test_statements_add_up_to_the_billed_total_and_show_nothing_internal(built) -> None:  # type: ignore[no-untyped-def]
    db, _, _ = built
    october = by(report(db, "payouts", "--period", "2026-10")["rows"], "app_id")
    november = by(report(db, "margin", "--period", "2026-11", "--by", "app")["rows"], "app_id")
    for app in APPS:
        for period, status in (("2026-10", "final"), ("2026-11", "provisional")):
            s = json.loads(cli(report_app, "statement", "--app", app, "--period", period, "--db", db))
            assert s["status"] == status and s["app"] == app and s["period"] == period
            assert not _internal(s), _internal(s)
            lines = sum(Decimal(line["amount"]) for line in s["lines"])
            adjustments = sum(Decimal(a["amount"]) for a in s["adjustments"])
            assert lines == Decimal(s["subtotal"]) and adjustments == Decimal(s["adjustments_total"])
            assert lines + adjustments == Decimal(s["total"])
            assert all(Decimal(line["amount"]) == Decimal(line["amount"]).quantize(CENT) for line in s["lines"])
            assert {line["bucket"] for line in s["lines"]} <= {"input_uncached", "cache_read", "cache_write_5m",
                                                                "cache_write_1h", "output", "requests"}
            if period == "2026-10":  # closed: the frozen statement's number and total
                assert Decimal(s["total"]) == Decimal(october[app]["billed_amount"])
                assert re.fullmatch(r"KVR-202610-\d{5}", s["statement"])
                assert s["adjustments"] == []
            else:
                assert Decimal(s["total"]) == Decimal(november[app]["billed_amount"]).quantize(CENT)
                # rounded with the residual carried line to line: each amount within a cent of its exact value
                assert abs(Decimal(s["adjustments_total"]) - Decimal(november[app]["adjustments"])) <= CENT
                assert {(a["kind"], a["from_period"]) for a in s["adjustments"]} == {("late_event", "2026-10")}
        texts = {fmt: cli(report_app, "statement", "--app", app, "--period", "2026-11", "--format", fmt, "--db", db)
                 for fmt in ("csv", "html")}
        for fmt, text in texts.items():
            shown = re.sub(r"<style.*?</style>|<[^>]+>", " ", text, flags=re.S)  # what a reader sees
            assert not re.search(r"margin|payout|markup|provider.cost|platform", shown, re.I), fmt
        rows = list(csv.DictReader(io.StringIO(texts["csv"])))
        assert rows[-1]["bucket"] == "total" and Decimal(rows[-1]["amount"]) == Decimal(s["total"])
        assert f"{s['total']} USD" in texts["html"]
    users = by(report(db, "margin", "--period", "2026-11", "--by", "end_user", "--app", "beta")["rows"], "end_user")
    s = json.loads(cli(report_app, "statement", "--app", "beta", "--period", "2026-11", "--customer",
                       "beta-cust-2", "--db", db))
    assert s["customer"] == "beta-cust-2" and re.fullmatch(r"KVR-202611-[0-9a-f]{8}-DRAFT-[0-9a-f]{8}", s["statement"])
    assert abs(Decimal(s["total"]) - Decimal(users["beta-cust-2"]["billed_amount"])) <= CENT
    r = runner.invoke(report_app, ["statement", "--app", "nobody", "--period", "2026-11", "--db", db])
    assert r.exit_code == 2 and "app 'nobody' has no usage booked in 2026-11" in r.output


def test_compare_puts_two_ranges_side_by_side(built) -> None:  # type: ignore[no-untyped-def]
    db, _, _ = built
    result = report(db, "compare", "--before", "2026-10-01..2026-10-31", "--after", "2026-11", "--app", "acme")
    before = by(report(db, "usage", "--from", "2026-10-01", "--to", "2026-10-31", "--by", "app")["rows"], "app_id")
    after = by(report(db, "usage", "--from", "2026-11-01", "--to", "2026-11-30", "--by", "app")["rows"], "app_id")
    rows = by(result["rows"], "figure")
    assert result["before"] == "2026-10-01..2026-10-31" and result["after"] == "2026-11-01..2026-11-30"
    for name in ("cache_hit_ratio", "cache_savings", "ttft_p50_ms", "ttft_p90_ms", "cost_per_request",
                 "cost_per_session_p90"):
        assert (rows[name]["before"], rows[name]["after"]) == (before["acme"][name], after["acme"][name]), name
    assert Decimal(rows["cache_savings"]["change"]) == Decimal(after["acme"]["cache_savings"]) - Decimal(
        before["acme"]["cache_savings"])
    assert rows["ttft_p90_ms"]["change"] == after["acme"]["ttft_p90_ms"] - before["acme"]["ttft_p90_ms"]
    r = runner.invoke(report_app, ["compare", "--before", "2026-10-05..2026-10-01", "--after", "2026-11",
                                   "--db", db])
    assert r.exit_code == 2 and "--before: 2026-10-05..2026-10-01 ends before it starts" in r.output


def test_the_table_fits_a_terminal_and_an_empty_range_says_so_in_one_line(built) -> None:  # type: ignore[no-untyped-def]
    db, _, _ = built
    r = runner.invoke(report_app, ["usage", "--period", "2026-11", "--by", "app", "--db", db], env={"COLUMNS": "400"})
    widest = max(len(line) for line in r.stdout.splitlines())
    assert r.exit_code == 0 and widest <= 120, widest
    assert "0.0000" not in r.stdout and re.search(r"│ beta .*│ +\d+\.\d\d │", r.stdout)  # money read to the cent
    r = runner.invoke(report_app, ["usage", "--period", "2026-11", "--by", "app", "--columns", "app_id,nope",
                                   "--db", db])
    assert r.exit_code == 2 and "--columns: unknown column 'nope'" in r.output
    r = runner.invoke(report_app, ["margin", "--from", "2026-12-01", "--to", "2026-12-07", "--db", db])
    assert r.exit_code == 0 and r.stdout == "no usage in 2026-12-01..2026-12-07 in this ledger\n"
    r = runner.invoke(report_app, ["usage", "--period", "2026-11", "--from", "2026-11-01", "--db", db])
    assert r.exit_code == 2 and "give either --period or --from/--to" in r.output


# --- the page, in a real headless browser ---------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Figures(HTMLParser):
    """Every element with ``data-figure``: (app, day or None, column) -> (shown text, data-value)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, str | None, str], tuple[str, str]] = {}
        self._open: tuple[tuple[str, str | None, str], str] | None = None
        self._text: list[str] = []
        self.resources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for name in ("src", "href"):
            if a.get(name):
                self.resources.append(f"{tag} {name}={a[name]}")
        if tag in ("script", "link", "img", "iframe", "object", "embed"):
            self.resources.append(tag)
        if "data-figure" in a:
            self._open = ((a["data-app"] or "", a.get("data-day"), a["data-figure"] or ""), a.get("data-value") or "")
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and tag in ("div", "td"):
            key, value = self._open
            self.found[key] = ("".join(self._text).strip(), value)
            self._open = None


def chromium(url: str, *args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    """Headless Chromium, offline: no network service, every host unresolvable."""
    return subprocess.run([CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}",
                           *args, url], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("KVROUTE_TEST_REQUIRE_CHROMIUM"),
                    reason="no chromium on this machine (apt-get install -y chromium; .ci/run installs it and "
                           "sets KVROUTE_TEST_REQUIRE_CHROMIUM=1, so CI never skips)")
def test_the_page_renders_offline_in_chromium_and_shows_the_json_reports_figures(built) -> None:  # type: ignore[no-untyped-def]
    from kvroute.billing.export import cell_text
    db, _, folder = built
    page = folder / "november.html"
    out = cli(report_app, "html", "--period", "2026-11", "--out", str(page), "--db", db)
    assert "4 app(s), 2026-11-01..2026-11-30" in out
    source = page.read_text()
    assert not re.search(r"""(?:src|href)\s*=|url\(|@import""", source)  # nothing to fetch
    dom = chromium(page.as_uri(), "--dump-dom", profile=folder / "chromium")
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = Figures()
    parsed.feed(dom.stdout)
    assert parsed.resources == []
    assert dom.stdout.count("<svg") == 3 * len(APPS)  # three charts per app, drawn inline
    apps = report(db, "margin", "--from", "2026-11-01", "--to", "2026-11-30", "--by", "app")
    days = report(db, "margin", "--from", "2026-11-01", "--to", "2026-11-30", "--by", "app,day")
    expected: dict[tuple[str, str | None], dict[str, Any]] = {(r["app_id"], None): r for r in apps["rows"]}
    expected.update({(r["app_id"], r["day"]): r for r in days["rows"]})
    expected[("TOTAL", None)] = apps["totals"][0]
    columns = {c for (_, _, c) in parsed.found}
    assert columns == {"requests_total", "spend", "billed_amount", "margin_amount", "cache_savings",
                       "cache_hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "error_rate"}
    checked = 0
    for (app, day, column), (shown, value) in parsed.found.items():
        want = expected[(app, day)][column]
        exact = "" if want is None else str(want)
        assert value == exact, (app, day, column, value, want)
        typed = Decimal(want) if isinstance(want, str) else want
        assert shown == (cell_text(typed, column) or "–"), (app, day, column, shown)
        checked += 1
    assert {(a, d) for (a, d, _) in parsed.found} == set(expected)
    assert checked >= 9 * (len(APPS) * 25)
    shot = chromium(page.as_uri(), f"--screenshot={folder / 'page.png'}", "--window-size=1000,1800",
                    profile=folder / "chromium")
    assert shot.returncode == 0 and (folder / "page.png").stat().st_size > 20_000, shot.stderr[-2000:]


# --- SQLite and PostgreSQL give the same reports ---------------------------------------------------------------------
def test_postgresql_gives_the_same_reports_as_sqlite(pg_url: str, tmp_path: Path) -> None:
    ledger = generate(seed=7, requests=400, late=10)
    sqlite = f"sqlite:///{tmp_path / 'ledger.db'}"
    (tmp_path / "pg").mkdir()
    load(sqlite, tmp_path, ledger)
    load(pg_url, tmp_path / "pg", ledger)
    for args in (("margin", "--period", "2026-11", "--by", "app,day"), ("usage", "--period", "2026-10", "--by", "tag"),
                 ("usage", "--from", "2026-10-25", "--to", "2026-11-05", "--by", "session"),
                 ("margin", "--from", "2026-10-01", "--to", "2026-11-30", "--by", "app")):
        a, b = report(sqlite, *args), report(pg_url, *args)
        for x, y in zip(a["rows"] + a["totals"], b["rows"] + b["totals"], strict=True):
            assert x == y, (args, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)})
    for period in ("2026-10", "2026-11"):
        a = json.loads(cli(report_app, "statement", "--app", "acme", "--period", period, "--db", sqlite))
        b = json.loads(cli(report_app, "statement", "--app", "acme", "--period", period, "--db", pg_url))
        assert {k: v for k, v in a.items() if k != "issued"} == {k: v for k, v in b.items() if k != "issued"}



def test_every_grouping_partitions_the_same_totals(built) -> None:  # type: ignore[no-untyped-def]
    """Rows of any one level (or two) add up to the same totals; only tags may count a request twice."""
    db, _, _ = built
    base = report(db, "margin", "--period", "2026-11", "--by", "app")["totals"][0]
    additive = ("requests_total", "input_tokens_uncached", "cache_read_tokens", "billed_amount", "spend",
                "absorbed_cost", "platform_fee", "payout_share")
    for grouping in ("day", "model", "backend", "provider", "end_user", "key", "session", "model,day", "app,day"):
        data = report(db, "margin", "--period", "2026-11", "--by", grouping)
        assert {k: data["totals"][0][k] for k in additive} == {k: base[k] for k in additive}, grouping
        for column in additive:
            summed = sum(Decimal(str(r[column])) for r in data["rows"])
            assert summed == Decimal(str(base[column])), (grouping, column)
        assert data["totals"][0]["payout_amount"] == base["payout_amount"]
    keys = report(db, "usage", "--period", "2026-11", "--by", "key")["rows"]
    assert {r["api_key_hash"] for r in keys} == {"(none)"}  # the generated lines carry no key hash
