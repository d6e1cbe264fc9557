"""``kvroute billing dead-letter list|retry``: an operator sees a refused event, fixes its line, re-ingests it."""

from __future__ import annotations

import json
from pathlib import Path

from billing_helpers import event
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app
from kvroute.billing.deadletter import DeadLetter
from kvroute.billing.ledger import Ledger

runner = CliRunner()


def test_list_then_fix_then_retry(tmp_path: Path) -> None:
    data = tmp_path / "data"
    dead = DeadLetter(data)
    bad = event(7).to_json()
    bad["attempt"] = "x"  # what a broken writer once produced
    dead.append(json.dumps(bad), "invalid event: attempt must be a non-negative integer", "journal")
    assert dead.path.stat().st_mode & 0o777 == 0o600
    r = runner.invoke(billing_app, ["dead-letter", "list", "--data-dir", str(data)])
    assert r.exit_code == 0 and "invalid event: attempt" in r.output and "1 dead-lettered" in r.output
    r = runner.invoke(billing_app, ["dead-letter", "retry", "--data-dir", str(data)])
    assert r.exit_code == 1 and "0 stored, 1 still dead-lettered" in r.output
    entry = json.loads(dead.path.read_text())
    fixed = json.loads(entry["line"])
    fixed["attempt"] = 0
    entry["line"] = json.dumps(fixed)
    dead.path.write_text(json.dumps(entry) + "\n")
    r = runner.invoke(billing_app, ["dead-letter", "retry", "--data-dir", str(data)])
    assert r.exit_code == 0, r.output
    assert "1 stored, 0 still dead-lettered" in r.output and dead.entries() == []
    led = Ledger.open(f"sqlite:///{data / 'billing.db'}")
    try:
        assert led.count_events() == 1
    finally:
        led.close()
