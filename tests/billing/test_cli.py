"""``kvroute billing ingest|load-prices|close-period`` and ``kvroute report usage|margin|payouts``."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from billing_helpers import PRICES, event
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.reports import MARGIN_COLUMNS, PAYOUT_COLUMNS, USAGE_COLUMNS
from kvroute.billing.usage import TokenBuckets

runner = CliRunner()
OLD_OK = ("--late-days", "3650")  # the fixtures are dated October 2026; the window is relative to the real clock


@pytest.fixture
def loaded(tmp_path: Path) -> str:
    db = str(tmp_path / "billing.db")
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump(PRICES))
    r = runner.invoke(billing_app, ["load-prices", str(prices), "--db", db])
    assert r.exit_code == 0, r.output
    assert "price books +2" in r.output
    events = tmp_path / "events.jsonl"
    lines = [event(i, provider_cost=Decimal("0.0123")).to_line() for i in range(30)]
    lines += [event(i, app_id="beta", backend_id="vllm-a", provider="self_hosted", served_model="llama-8b",
                    route_kind="self_hosted").to_line() for i in range(10)]
    events.write_text("\n".join(lines) + "\n")
    r = runner.invoke(billing_app, ["ingest", str(events), "--db", db, *OLD_OK])
    assert r.exit_code == 0, r.output
    assert "40 valid events, 40 inserted" in r.output
    r = runner.invoke(billing_app, ["ingest", str(events), "--db", db, *OLD_OK])
    assert "0 inserted, 40 already present" in r.output
    return db


def test_ingest_reports_each_bad_line_and_inserts_nothing(tmp_path: Path, loaded: str) -> None:
    good = event(100).to_json()
    bad_lines = [json.dumps(good), "{not json", json.dumps({**good, "request_id": "x2", "status": "weird"}),
                 json.dumps({**good, "request_id": "x3", "usage": {"input_uncached": -4}}), "",
                 json.dumps({k: v for k, v in good.items() if k not in ("app_id", "event_id")})]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad_lines) + "\n")
    r = runner.invoke(billing_app, ["ingest", str(path), "--db", loaded, *OLD_OK])
    assert r.exit_code == 2
    assert "line 2: (json): not valid JSON" in r.output
    assert "line 3: status: must be one of" in r.output
    assert "line 4: usage.input_uncached: must be a non-negative integer" in r.output
    assert "line 6: app_id: is required" in r.output
    assert "nothing was inserted" in r.output
    r = runner.invoke(report_app, ["usage", "--period", "2026-10", "--format", "json", "--db", loaded])
    assert sum(row["requests_total"] for row in json.loads(r.output)["rows"]) == 40  # line 1 was not inserted
    r = runner.invoke(billing_app, ["ingest", str(path), "--db", loaded, "--skip-invalid", *OLD_OK])
    assert r.exit_code == 0 and "1 valid events, 1 inserted" in r.output


def test_load_prices_names_the_bad_rule(tmp_path: Path) -> None:
    broken = json.loads(json.dumps(PRICES))
    broken["price_books"][1]["rules"][0]["markup_pct"] = "twenty"
    path = tmp_path / "prices.toml"
    import tomllib  # noqa: F401 - TOML is read with the standard library; written here by hand
    path.write_text('currency = "USD"\n[[price_books]]\napp = "acme"\nversion = 1\neffective_from = 2026-01-01\n'
                    '[[price_books.rules]]\nname = "claude"\nmarkup_pct = "twenty"\n')
    r = runner.invoke(billing_app, ["load-prices", str(path), "--check"])
    assert r.exit_code == 2
    assert "price_books[acme v1].rules[claude].markup_pct: not a decimal amount" in r.output
    path.write_text('[[price_books]]\nversion = 1\neffective_from = 2026-01-01\n'
                    '[[price_books.rules]]\nname = "all"\nmarkup_pct = "0.2"\n')
    r = runner.invoke(billing_app, ["load-prices", str(path), "--check"])
    assert r.exit_code == 0 and "1 books" in r.output


def test_reports_in_every_format(tmp_path: Path, loaded: str) -> None:
    r = runner.invoke(report_app, ["margin", "--period", "2026-10", "--format", "csv", "--db", loaded])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.output)))
    assert list(rows[0]) == list(MARGIN_COLUMNS)
    assert [row["app_id"] for row in rows] == ["acme", "beta", "TOTAL"]
    acme = rows[0]
    assert Decimal(acme["billed_amount"]) == Decimal("0.0123") * Decimal("1.2") * 30 + Decimal(
        "0.0005") * 30 * 0 + (1000 * Decimal("0.5") + 400) / Decimal(1_000_000) * 30
    assert Decimal(rows[2]["billed_amount"]) == Decimal(acme["billed_amount"]) + Decimal(rows[1]["billed_amount"])
    out = tmp_path / "usage.json"
    r = runner.invoke(report_app, ["usage", "--period", "2026-10", "--app", "beta", "--format", "json",
                                   "--out", str(out), "--db", loaded])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [row["app_id"] for row in data["rows"]] == ["beta"] and list(data["rows"][0]) == list(USAGE_COLUMNS)
    assert data["totals"][0]["requests_total"] == 10
    pq = tmp_path / "payouts.parquet"
    r = runner.invoke(report_app, ["payouts", "--period", "2026-10", "--format", "parquet", "--out", str(pq),
                                   "--db", loaded])
    assert r.exit_code == 0, r.output
    import polars as pl
    frame = pl.read_parquet(pq)
    assert frame.columns == list(PAYOUT_COLUMNS)
    assert isinstance(frame.schema["billed_amount"], pl.Decimal)
    assert frame.filter(pl.col("app_id") == "acme")["status"].to_list() == ["provisional"]
    r = runner.invoke(report_app, ["margin", "--period", "2026-10", "--db", loaded], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "kvroute margin report 2026-10" in r.output and "TOTAL" in r.output
    r = runner.invoke(report_app, ["usage", "--period", "2026-13", "--db", loaded])
    assert r.exit_code == 2 and "expected YYYY-MM" in r.output


def test_an_empty_period_says_so_in_one_line(loaded: str) -> None:
    r = runner.invoke(report_app, ["margin", "--period", "2025-01", "--db", loaded])
    assert r.exit_code == 0 and r.output == "no usage in 2025-01 in this ledger\n"
    r = runner.invoke(report_app, ["usage", "--period", "2026-10", "--app", "nobody", "--format", "json", "--db",
                                   loaded])
    assert r.exit_code == 0 and "no usage in 2026-10 for app nobody in this ledger" in r.output


def test_a_request_refused_before_any_call_is_not_an_unpriced_event(tmp_path: Path, loaded: str) -> None:
    """What LiteLLM rejects before an upstream call (``no_route`` on ``router``) warns of nothing to re-rate."""
    refused = event(500, status="no_route", is_final=True, backend_id="router", provider="litellm-router",
                    route_kind="direct", tokens=TokenBuckets(0, 0, 0, 0, 0, 0))
    path = tmp_path / "refused.jsonl"
    path.write_text(refused.to_line() + "\n")
    r = runner.invoke(billing_app, ["ingest", str(path), "--db", loaded, *OLD_OK])
    assert r.exit_code == 0 and "unpriced" not in r.output, r.output
    r = runner.invoke(report_app, ["margin", "--period", "2026-10", "--format", "json", "--db", loaded])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    rows = json.loads(r.output[r.output.index("{"):])["rows"]
    router = next(row for row in rows if row["backend_id"] == "router")
    assert router["requests_total"] == 1 and router["unpriced_events"] == 0 and Decimal(router["billed_amount"]) == 0


def test_a_missing_price_file_is_named_once(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    r = runner.invoke(billing_app, ["load-prices", str(missing), "--check"])
    assert r.exit_code == 2 and r.output == f"{missing}: cannot read price file: No such file or directory\n"


def test_close_period_command(loaded: str) -> None:
    r = runner.invoke(billing_app, ["close-period", "--period", "2026-10", "--db", loaded, "--force"])
    assert r.exit_code == 0, r.output
    assert "closed; 2 statement(s) for 2 app(s)" in r.output
    r = runner.invoke(report_app, ["payouts", "--period", "2026-10", "--format", "json", "--db", loaded])
    rows = json.loads(r.output)["rows"]
    assert {row["app_id"]: row["status"] for row in rows} == {"acme": "pending", "beta": "pending"}
    acme = next(row for row in rows if row["app_id"] == "acme")
    assert Decimal(acme["billed_amount"]) == Decimal(acme["billed_amount"]).quantize(Decimal("0.01"))


def test_mounted_on_the_kvroute_command() -> None:
    from kvroute.plugin.cli.cli import app
    r = runner.invoke(app, ["report", "--help"])
    assert r.exit_code == 0 and "payouts" in r.output
    r = runner.invoke(app, ["billing", "--help"])
    assert r.exit_code == 0 and "close-period" in r.output
