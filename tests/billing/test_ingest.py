"""``kvroute billing ingest`` on SQLite and PostgreSQL: each known ingest defect as a test through the CLI.

Events are dated relative to the real clock (the CLI's late-event window is relative to it).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from billing_helpers import PRICES
from sqlalchemy import select
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.events import event_from_json
from kvroute.billing.ingest import ingest_file
from kvroute.billing.ledger import Ledger
from kvroute.billing.models import UsageEventRow
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.policies.errors import InputError

runner = CliRunner()
NOW = datetime.now(UTC).replace(microsecond=0)


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def line(i: int, **over: Any) -> dict[str, Any]:
    """One event of app acme on the OpenRouter Claude backend, an hour ago."""
    data: dict[str, Any] = {"request_id": f"r-{i}", "app_id": "acme", "occurred_at": stamp(NOW - timedelta(hours=1)),
                            "served_model": "claude-sonnet", "provider": "openrouter", "backend_id": "or-claude",
                            "route_kind": "marketplace",
                            "usage": {"input_uncached": 1000, "cache_read": 3000, "output": 400}}
    data.update(over)
    return {k: v for k, v in data.items() if v is not None}


def write(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def db(db_url: str, tmp_path: Path) -> str:
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump(PRICES))
    r = runner.invoke(billing_app, ["load-prices", str(prices), "--db", db_url])
    assert r.exit_code == 0, r.output
    return db_url


def ingest(db: str, path: Path, *extra: str) -> Any:
    return runner.invoke(billing_app, ["ingest", str(path), "--db", db, *extra])


def stored(db: str) -> dict[str, Any]:
    ledger = Ledger.open(db)
    try:
        with ledger.engine.connect() as conn:
            return {r.request_id: r for r in conn.execute(select(UsageEventRow.__table__))}
    finally:
        ledger.close()


def test_openrouter_cost_as_a_json_number_is_exact_and_the_whole_file_lands(db: str, tmp_path: Path) -> None:
    """Before: ``TypeError: Decimal is not JSON serializable`` in the first batch with such a line, the file
    partly stored (earlier batches) and every re-run crashing at the same place."""
    usage = '{"prompt_tokens": 10339, "completion_tokens": 60, "cost": 0.00492, ' \
            '"prompt_tokens_details": {"cached_tokens": 10318}, "cost_details": {"upstream_inference_cost": 0.0041}}'
    rows: list[dict[str, Any] | str] = [line(i) for i in range(6)]
    for i in range(6, 12):
        head = json.dumps({k: v for k, v in line(i).items() if k != "usage"})
        rows.append(head[:-1] + f', "raw_usage": {usage}, "provider_cost": 0.1234567890123}}')
    path = write(tmp_path / "or.jsonl", rows)
    r = ingest(db, path, "--batch-size", "4")
    assert r.exit_code == 0, r.output
    assert "12 valid events, 12 inserted" in r.output
    r = ingest(db, path, "--batch-size", "4")
    assert r.exit_code == 0 and "0 inserted, 12 already present" in r.output
    row = stored(db)["r-7"]
    assert row.provider_cost == Decimal("0.1234567890") and row.provider_cost_reported == Decimal("0.1234567890")
    assert row.cost_source == "provider_reported"
    assert row.raw_usage["cost"] == 0.00492 and row.cache_read_tokens == 10318


def test_raw_usage_cost_is_the_provider_cost(db: str, tmp_path: Path) -> None:
    """Before: without ``provider_cost`` the event was rated from the rate card and ``usage.cost`` ignored."""
    raw = {"prompt_tokens": 4000, "completion_tokens": 400, "cost": 0.00031,
           "prompt_tokens_details": {"cached_tokens": 3000}}
    nested = {"usage": {"prompt_tokens": 10, "completion_tokens": 1, "cost": "0.5"}}
    path = write(tmp_path / "cost.jsonl", [
        {k: v for k, v in line(1, raw_usage=raw).items() if k != "usage"},
        {k: v for k, v in line(2, raw_usage=nested).items() if k != "usage"},
        line(3, raw_usage={"cost": 0.25}),  # buckets in usage, cost in raw_usage
    ])
    r = ingest(db, path)
    assert r.exit_code == 0, r.output
    rows = stored(db)
    assert rows["r-1"].provider_cost == Decimal("0.00031") and rows["r-1"].cost_source == "provider_reported"
    assert rows["r-2"].provider_cost == Decimal("0.5")
    assert rows["r-3"].provider_cost == Decimal("0.25")
    assert rows["r-1"].billed_amount == Decimal("0.00031") * Decimal("1.2") + (1000 * Decimal("0.5") + 400) / 10**6


@pytest.mark.parametrize(("bad", "where"), [
    ({"raw_usage": {"prompt_tokens": "1000", "completion_tokens": 5}}, "usage.prompt_tokens"),
    ({"raw_usage": {"prompt_tokens": 1000, "completion_tokens": "5"}}, "usage.completion_tokens"),
    ({"raw_usage": {"prompt_tokens": 10.5, "completion_tokens": 5}}, "usage.prompt_tokens"),
    ({"raw_usage": {"prompt_tokens": 10, "completion_tokens": True}}, "usage.completion_tokens"),
    ({"raw_usage": {"prompt_tokens": 10, "prompt_tokens_details": "cached"}}, "usage.prompt_tokens_details"),
    ({"raw_usage": {}}, "raw_usage"),
    ({"raw_usage": ["prompt_tokens", 5]}, "raw_usage"),
    ({"raw_usage": {"prompt_tokens": 10, "completion_tokens": 1, "cost": "cheap"}}, "raw_usage.cost"),
    ({"raw_usage": {"prompt_tokens": 10, "completion_tokens": 1, "cost": -0.1}}, "raw_usage.cost"),
    ({"raw_usage": {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 100,
                    "cache_creation": {"ephemeral_5m_input_tokens": 80, "ephemeral_1h_input_tokens": 50}}},
     "usage.cache_creation"),
    ({"usage": {"input_uncached": "1000"}}, "usage.input_uncached"),
    ({"usage": {"input_uncached": 10**13}}, "usage.input_uncached"),
    ({"provider_cost": 10**9}, "provider_cost"),
])
def test_wrong_types_are_line_errors(db: str, tmp_path: Path, bad: dict[str, Any], where: str) -> None:
    """Before: string token counts became 0, ``raw_usage: {}`` was a free event, a cache-write split larger
    than its total was billed."""
    row = line(2, **bad)
    if "raw_usage" in bad:
        row.pop("usage")
    path = write(tmp_path / "bad.jsonl", [line(1), row])
    r = ingest(db, path)
    assert r.exit_code == 2, r.output
    assert f"line 2: {where}: " in r.output and "nothing was inserted" in r.output
    assert stored(db) == {}


@pytest.mark.parametrize(("currency_of", "where"), [("event", "currency"), ("rate card", "currency")])
def test_currencies_are_never_mixed(db: str, tmp_path: Path, currency_of: str, where: str) -> None:
    """Before: an EUR cost or an EUR rate card under the USD price book was booked as USD."""
    if currency_of == "event":
        bad = line(2, provider_cost="1.00", currency="EUR")
    else:
        prices = {"backends": [{"id": "eu-gpu", "provider": "self_hosted", "route_kind": "self_hosted",
                                "rates": [{"effective_from": "2026-01-01", "currency": "EUR",
                                           "input_per_mtok": "1", "output_per_mtok": "2"}]}]}
        store = Ledger.open(db)
        try:
            store_prices(store, parse_price_data(prices))
        finally:
            store.close()
        bad = line(2, backend_id="eu-gpu", provider="self_hosted", route_kind="self_hosted")
    path = write(tmp_path / "eur.jsonl", [line(1), bad, line(3, provider_cost="1.00", currency="EUR",
                                                             app_id="euro-app")])
    r = ingest(db, path)
    assert r.exit_code == 2, r.output
    assert f"line 2: {where}: " in r.output and "never converted" in r.output
    assert "line 3" in r.output  # euro-app has no book of its own: the default book is in USD
    assert stored(db) == {}
    r = ingest(db, path, "--skip-invalid")
    assert r.exit_code == 0 and set(stored(db)) == {"r-1"}


def test_an_event_in_the_books_currency_is_accepted(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'eur.db'}"
    ledger = Ledger.open(url)
    try:
        store_prices(ledger, parse_price_data({"currency": "EUR", "price_books": [
            {"version": 1, "effective_from": "2026-01-01", "rules": [{"name": "all", "markup_pct": "0.1"}]}]}))
        path = write(tmp_path / "e.jsonl", [line(1, provider_cost="2.00", currency="EUR")])
        result = ingest_file(ledger, path)
        assert result.inserted == 1 and not result.errors
    finally:
        ledger.close()
    assert stored(url)["r-1"].currency == "EUR" and stored(url)["r-1"].billed_amount == Decimal("2.2")


def test_unpriced_backends_are_flagged(db: str, tmp_path: Path) -> None:
    """Before: an event on a backend with no rate card and no reported cost was billed at 0 with no flag."""
    path = write(tmp_path / "u.jsonl", [line(1, provider_cost="0.01"),
                                        line(2, backend_id="mystery", provider="nobody", served_model="m"),
                                        line(3, backend_id="mystery", provider="nobody", served_model="m")])
    r = ingest(db, path)
    assert r.exit_code == 0, r.output
    assert "warning: 2 event(s) on backend 'mystery' have no reported cost and no rate card" in r.output
    period = f"{(NOW - timedelta(hours=1)).year:04d}-{(NOW - timedelta(hours=1)).month:02d}"
    r = runner.invoke(report_app, ["margin", "--period", period, "--format", "json", "--db", db])
    assert r.exit_code == 0, r.output
    assert "warning: 2 event(s) had no reported cost and no rate card" in r.output
    out = json.loads(r.output[r.output.index("{"):])
    mystery = next(x for x in out["rows"] if x["backend_id"] == "mystery")
    assert mystery["unpriced_events"] == 2 and "UNPRICED" in mystery["pricing_rule"]
    assert next(x for x in out["rows"] if x["backend_id"] == "or-claude")["unpriced_events"] == 0
    assert out["totals"][0]["unpriced_events"] == 2


def test_late_event_window_and_future_dates(db: str, tmp_path: Path) -> None:
    """Before: a three-month-old event became an adjustment and an event dated 2030 was accepted."""
    rows = [line(1, occurred_at=stamp(NOW - timedelta(days=34))),
            line(2, occurred_at=stamp(NOW - timedelta(days=90))),
            line(3, occurred_at="2030-01-01T00:00:00Z"),
            line(4, occurred_at=stamp(NOW + timedelta(seconds=60))),  # clock skew inside the allowance
            line(5, occurred_at=stamp(NOW + timedelta(minutes=10))),
            line(6, occurred_at="9999-12-31T23:59:59-05:00"), line(7, occurred_at="0001-01-01T00:00:00Z")]
    path = write(tmp_path / "late.jsonl", rows)
    r = ingest(db, path)
    assert r.exit_code == 2, r.output
    assert "line 2: occurred_at: is 90 days old; events older than the late-event window of 35 days" in r.output
    assert "line 3: occurred_at: 2030-01-01T00:00:00+00:00 is in the future" in r.output
    assert "line 5: occurred_at: " in r.output and "in the future" in r.output
    assert "line 6: occurred_at: out of range" in r.output and "line 7: occurred_at: is 739" in r.output
    assert "line 1:" not in r.output and "line 4:" not in r.output
    r = ingest(db, path, "--skip-invalid")
    assert r.exit_code == 0 and set(stored(db)) == {"r-1", "r-4"}
    r = ingest(db, write(tmp_path / "l2.jsonl", [rows[1]]), "--late-days", "100")  # the window is configurable
    assert r.exit_code == 0 and "1 inserted" in r.output


def test_the_window_reads_the_settings(monkeypatch: pytest.MonkeyPatch, db: str, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_BILLING_LATE_EVENT_DAYS", "10")
    path = write(tmp_path / "w.jsonl", [line(1, occurred_at=stamp(NOW - timedelta(days=20)))])
    r = ingest(db, path)
    assert r.exit_code == 2 and "late-event window of 10 days" in r.output
    from kvroute.billing.ingest import EventWindow
    window = EventWindow(late_days=1, future_skew_s=0)
    assert window.check(NOW, NOW) is None and window.check(NOW + timedelta(seconds=1), NOW)


#: The column limits (stated here on their own, checked against ``events.FIELD_LIMITS`` below).
LIMITS: dict[str, int | range] = {
    "request_id": 200, "app_id": 200, "served_model": 200, "requested_model": 200, "provider": 100,
    "backend_id": 200, "end_user": 200, "api_key_hash": 128, "error_type": 100, "attempt_key": 1000,
    "attempt": range(2**31), "http_status": range(1000), "fallback_depth": range(2**31), "ttft_ms": range(2**31),
    "duration_ms": range(2**31), "session_id": 200,
}


def test_the_limits_table_is_the_one_enforced() -> None:
    from kvroute.billing.events import FIELD_LIMITS
    assert FIELD_LIMITS == LIMITS


def _limit_cases() -> list[tuple[str, Any, bool]]:
    """(field, value, accepted) at and just past every limit, plus text both databases refuse."""
    cases: list[tuple[str, Any, bool]] = []
    for key, limit in LIMITS.items():
        if isinstance(limit, range):
            cases += [(key, limit.stop - 1, True), (key, limit.stop, False)]
        else:
            cases += [(key, "x" * limit, True), (key, "x" * (limit + 1), False)]
    cases += [("end_user", "a\x00b", False), ("request_id", "\ud800", False), ("error_type", "é" * 100, True),
              ("duration_ms", 2**31, False), ("attempt", 2**40, False), ("provider_cost", "1000000.5", True),
              ("provider_cost", "100000000.0000000001", False), ("litellm_cost", "1e40", False)]
    return cases


@pytest.mark.parametrize(("name", "value", "accepted"), _limit_cases())
def test_sqlite_and_postgresql_take_the_same_events(db: str, tmp_path: Path, name: str, value: Any,
                                                    accepted: bool) -> None:
    """Before: a ``request_id`` over 200 characters or ``duration_ms`` over 2**31 failed the whole batch on
    PostgreSQL only (SQLite stored them)."""
    row = line(1, **{name: value})
    if name == "requested_model":
        row["served_model"] = "claude-sonnet"
    if name == "attempt_key":
        row["attempt"] = 0
    path = tmp_path / "limits.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(line(2)) + "\n")
    r = ingest(db, path)
    if accepted:
        assert r.exit_code == 0, r.output
        assert "2 inserted" in r.output
    else:
        assert r.exit_code == 2, r.output
        assert f"line 1: {name}: " in r.output
        assert stored(db) == {}


def test_rated_amounts_must_fit_the_ledger(db: str, tmp_path: Path) -> None:
    path = write(tmp_path / "big.jsonl", [line(1, provider_cost="99999999")])  # + 20 % markup: over 1e8
    r = ingest(db, path)
    assert r.exit_code == 2 and "line 1: billed_amount: " in r.output and "exceeds the ledger's limit" in r.output


def test_archived_usage_is_stored_alike_on_both(db: str, tmp_path: Path) -> None:
    """raw_usage keeps what both databases can hold: NUL and lone surrogates replaced, exact numbers as JSON."""
    raw = {"prompt_tokens": 10, "completion_tokens": 2, "note": "a\x00b\ud800", "cost": 0.1, "big": 1e400}
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps({k: v for k, v in line(1, raw_usage=raw).items() if k != "usage"}) + "\n")
    r = ingest(db, path)
    assert r.exit_code == 2 and "not valid JSON" in r.output  # 1e400 is written as Infinity by json.dumps
    raw.pop("big")
    path.write_text(json.dumps({k: v for k, v in line(1, raw_usage=raw).items() if k != "usage"}) + "\n")
    r = ingest(db, path)
    assert r.exit_code == 0, r.output
    assert stored(db)["r-1"].raw_usage["note"] == "a\ufffdb?"


def test_an_interrupted_ingest_resumes_and_stores_each_event_once(db: str, tmp_path: Path) -> None:
    """A crash after some batches committed: the re-run stores the rest, nothing twice."""
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "cost": 0.001}
    rows = [{k: v for k, v in line(i, raw_usage=usage).items() if k != "usage"} for i in range(250)]
    path = write(tmp_path / "big.jsonl", rows)

    class Crash(Exception):
        pass

    class DiesAfterTwoBatches(Ledger):
        batches = 0

        def insert_events(self, events, rated=None):  # type: ignore[no-untyped-def]
            if self.batches == 2:
                raise Crash
            self.batches += 1
            return super().insert_events(events, rated)

    ledger = DiesAfterTwoBatches.open(db)
    try:
        with pytest.raises(Crash):
            ingest_file(ledger, path, batch_size=100)
    finally:
        ledger.close()
    assert len(stored(db)) == 200
    r = ingest(db, path, "--batch-size", "100")
    assert r.exit_code == 0, r.output
    assert "250 valid events, 50 inserted, 200 already present" in r.output
    rows_stored = stored(db)
    assert len(rows_stored) == 250 and all(r.provider_cost == Decimal("0.001") for r in rows_stored.values())


def test_progress_bar_on_long_files(db: str, tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", [line(i) for i in range(5000)])
    seen: list[tuple[str, int, int]] = []
    ledger = Ledger.open(db)
    try:
        result = ingest_file(ledger, path, batch_size=1000, progress=lambda *a: seen.append(a))
    finally:
        ledger.close()
    assert result.inserted == 5000
    reads = [s for s in seen if s[0] == "read"]
    inserts = [s for s in seen if s[0] == "insert"]
    assert reads[-1][1] == reads[-1][2] == path.stat().st_size and len(reads) >= 3
    assert [s[1] for s in inserts] == [1000, 2000, 3000, 4000, 5000] and inserts[-1][2] == 5000
    r = ingest(db, path, "--progress")
    assert r.exit_code == 0 and "checking (bytes)" in r.output and "100%" in r.output


def test_json_lines_are_parsed_exactly_and_safely() -> None:
    from kvroute.billing.ingest import parse_line
    assert parse_line(b'{"a": 0.1, "b": 12}') == {"a": Decimal("0.1"), "b": 12}
    for bad in (b'{"a": NaN}', b'{"a": Infinity}', b'{"a": ' + b"9" * 5000 + b"}", b"[" * 100000 + b"]" * 100000):
        with pytest.raises((ValueError, RecursionError)):
            parse_line(bad)
    with pytest.raises(InputError, match=r"usage\.completion_tokens"):
        event_from_json({**line(1, raw_usage={"prompt_tokens": 5, "completion_tokens": Decimal("1.5")}),
                         "usage": None})
    e = event_from_json({**line(1, raw_usage={"prompt_tokens": 5, "completion_tokens": Decimal("2.0")}),
                         "usage": None})
    assert e.tokens.output == 2 and e.raw_usage == {"prompt_tokens": 5, "completion_tokens": 2}


def test_the_request_path_is_lenient_where_ingest_is_strict() -> None:
    """A provider's odd usage field must not cost a served request its ledger row; a file line is refused."""
    from kvroute.billing.events import fit_text
    from kvroute.billing.usage import TokenBuckets, normalize_usage
    odd = {"prompt_tokens": "12", "completion_tokens": 3, "prompt_tokens_details": "n/a"}
    assert normalize_usage(odd) == TokenBuckets(0, 0, 0, 0, 3, 0)
    with pytest.raises(InputError, match=r"usage\.prompt_tokens"):
        normalize_usage(odd, strict=True)
    split = {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 100,
             "cache_creation": {"ephemeral_5m_input_tokens": 80, "ephemeral_1h_input_tokens": 150}}
    assert normalize_usage(split, "anthropic") == TokenBuckets(10, 0, 0, 100, 1, 0)  # capped at the total
    long_user = "u" * 500
    fitted = fit_text("end_user", long_user)
    assert fitted is not None and len(fitted) == 200 and fitted != fit_text("end_user", "u" * 499)
    assert fit_text("end_user", "a\x00b") == "a\ufffdb" and fit_text("end_user", None) is None
    line_with_archive = {**line(1), "raw_usage": {"cost": "n/a", "prompt_tokens": "x"}}
    assert event_from_json(line_with_archive, archive=True).provider_cost is None  # a journal line's archive copy


def test_usage_and_raw_usage_with_token_counts_on_one_line_is_an_error_naming_the_line(db: str,
                                                                                      tmp_path: Path) -> None:
    """Before: a line with both silently took ``usage`` (the raw object's own counts were dropped)."""
    raw = {"prompt_tokens": 4000, "completion_tokens": 400, "prompt_tokens_details": {"cached_tokens": 3000}}
    path = write(tmp_path / "both.jsonl", [line(1), line(2, raw_usage=raw), line(3, raw_usage={"cost": "0.1"})])
    r = ingest(db, path)
    assert r.exit_code == 2 and "line 2: raw_usage: holds token counts beside usage" in r.output, r.output
    assert "line 1:" not in r.output and "line 3:" not in r.output and stored(db) == {}


def test_session_and_tags_are_stored_and_checked(db: str, tmp_path: Path) -> None:
    """The session id and tags a line names reach the ledger (tags sorted and unique, one row each)."""
    from kvroute.billing.models import UsageEventTagRow
    path = write(tmp_path / "s.jsonl", [line(1, session_id="s-1", tags=["team:a", "batch", "team:a"]), line(2),
                                        line(3, tags="batch"), line(4, tags=["x" * 101]),
                                        line(5, tags=[f"t{i}" for i in range(21)])])
    r = ingest(db, path)
    assert r.exit_code == 2
    assert "line 3: tags: must be a list of strings" in r.output
    assert "line 4: tags: a tag is 101 characters long; at most 100 are stored" in r.output
    assert "line 5: tags: 21 tags; at most 20 are stored" in r.output
    r = ingest(db, path, "--skip-invalid")
    assert r.exit_code == 0, r.output
    rows = stored(db)
    assert rows["r-1"].session_id == "s-1" and rows["r-2"].session_id is None
    ledger = Ledger.open(db)
    try:
        with ledger.engine.connect() as conn:
            tags = sorted(conn.execute(select(UsageEventTagRow.event_id, UsageEventTagRow.tag)).all())
    finally:
        ledger.close()
    assert tags == [(rows["r-1"].event_id, "batch"), (rows["r-1"].event_id, "team:a")]
    assert ingest(db, path, "--skip-invalid").exit_code == 0  # again: nothing new, no duplicate tag
