"""What commands print: ``--format table|json|csv`` wherever figures are printed, piped tables that are not cut,
no literal markup; the sample ``examples/prices.yaml`` and ``examples/usage.jsonl`` load and report."""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KVROUTE = [sys.executable, "-m", "kvroute.plugin.cli.cli"]


def kvroute(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**environ, "COLUMNS": "", **env})


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> str:
    db = str(tmp_path_factory.mktemp("ledger") / "billing.db")
    out = kvroute("billing", "load-prices", str(EXAMPLES / "prices.yaml"), "--db", db)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "backends +5, rate cards +5, price books +2 (0 unchanged)"
    out = kvroute("billing", "ingest", str(EXAMPLES / "usage.jsonl"), "--db", db, "--late-days", "3650")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "15 valid events, 15 inserted, 0 already present, 0 skipped"
    return db


@pytest.mark.slow
def test_sample_usage_reports_every_app_and_the_fallback(ledger):
    out = kvroute("report", "margin", "--period", "2026-10", "--format", "json", "--db", ledger)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = data["rows"] if isinstance(data, dict) else data
    assert {r["app_id"] for r in rows} == {"acme", "globex"}
    assert {r["backend_id"] for r in rows} >= {"replica-1", "replica-2", "replica-3", "provider-a", "provider-b"}
    billed = [r for r in rows if r["backend_id"] == "provider-b"]
    assert billed and all(int(r["requests_total"]) == 0 for r in billed)  # the failed attempt bills nobody


@pytest.mark.slow
def test_piped_report_table_keeps_every_row_on_one_line_uncut(ledger):
    out = kvroute("report", "margin", "--period", "2026-10", "--db", ledger)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == 10  # 9 (app, backend) rows and the total
    assert sum("globex" in r and "replica-3" in r for r in rows) == 1
    assert max(len(ln) for ln in out.stdout.splitlines()) > 80


def test_lint_excerpts_print_no_markup(tmp_path):
    log = tmp_path / "requests.jsonl"
    system = "Today is {}. You answer questions about our product catalogue, politely and in detail."
    log.write_text("\n".join(json.dumps({"model": "m", "user": "acme", "messages": [
        {"role": "system", "content": system.format(f"2026-10-0{i} 12:00:0{i}")},
        {"role": "user", "content": f"question {i}"}]}) for i in range(1, 5)) + "\n")
    out = kvroute("lint", str(log), "--excerpts")
    assert out.returncode == 0, out.stderr
    assert "[dim]" not in out.stdout and "[/dim]" not in out.stdout
    assert "Today is <TIMESTAMP>" in out.stdout
    rows = list(csv.DictReader(io.StringIO(kvroute("lint", str(log), "--format", "csv").stdout)))
    assert rows and rows[0]["kind"] == "timestamp" and rows[0]["app"]


@pytest.mark.slow
def test_simulate_prints_table_json_and_csv():
    args = ["simulate", "-w", "gsp", "-r", "2", "-q", "-p", "groups=4", "-p", "prompts_per_group=4",
            "--policies", "round_robin,cache_aware"]
    table = kvroute(*args)
    as_json = kvroute(*args, "--format", "json")
    as_csv = kvroute(*args, "--format", "csv")
    assert table.returncode == as_json.returncode == as_csv.returncode == 0, table.stderr + as_csv.stderr
    assert "round_robin" in table.stdout and "…" not in table.stdout
    assert json.loads(as_json.stdout)
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert {r["policy"] for r in rows} == {"round_robin", "cache_aware"}


def test_bench_decision_prints_csv():
    out = kvroute("bench", "decision", "--tokens", "1000", "--backends", "4", "--repeats", "10", "--no-litellm",
                  "--format", "csv")
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == "1000" and float(rows[0]["p50_us"]) > 0


def test_events_inspect_prints_csv():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = kvroute("events", "inspect", "--endpoint", f"tcp://127.0.0.1:{port}", "--bind", "--duration", "0.2",
                  "--format", "csv")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.startswith("source,") and header.endswith(",index_blocks") and "batches" in header
    assert row.endswith(",0")


def test_unknown_format_is_one_line():
    for args in (["bench", "decision", "--no-litellm"], ["simulate", "-w", "gsp"], ["status"]):
        out = kvroute(*args, "--format", "yaml")
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().startswith("error: --format: must be one of table, json, csv"), out.stderr
