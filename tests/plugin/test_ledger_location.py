"""One ledger location: the proxy writes where ``kvroute report``/``billing``/``dead-letter`` read; private files;
a data directory that is a file stops start-up with one line naming the key."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.events import UsageEvent, period_of
from kvroute.billing.recorder import UsageRecorder
from kvroute.billing.usage import TokenBuckets
from kvroute.plugin.adapter.billing_feed import billing_target
from kvroute.plugin.settings import KvrouteSettings

runner = CliRunner()


@pytest.fixture
def beside_a_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``KVROUTE_DATA_DIR`` set as the proxy has it, commands run from another folder, a usual umask."""
    data = tmp_path / "proxy-data"
    for name in ("KVROUTE_BILLING_DB", "KVROUTE_BILLING_SPOOL", "KVROUTE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVROUTE_DATA_DIR", str(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    old = os.umask(0o022)
    try:
        yield data
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_report_beside_the_proxy_reads_the_ledger_the_proxy_writes(beside_a_proxy: Path) -> None:
    data = beside_a_proxy
    db, journal, dead = billing_target(KvrouteSettings(), in_proxy=True)  # type: ignore[misc]
    now = datetime.now(UTC)
    rec = UsageRecorder(db, journal, dead_letter=dead, drain="thread", flush_interval_s=0.05).start()
    try:
        for i in range(3):
            rec.record(UsageEvent(request_id=f"r{i}", app_id="acme", occurred_at=now, served_model="m",
                                  provider="openai", backend_id="b-1", route_kind="direct",
                                  tokens=TokenBuckets(10, 0, 0, 0, 5, 0), provider_cost=Decimal("0.001")))
        assert rec.flush()
        ledger = data / "billing.db"
        assert _mode(data) == 0o700, oct(_mode(data))  # the ledger holds end-user ids and key hashes
        for f in (ledger, Path(f"{ledger}-wal"), Path(f"{ledger}-shm")):
            assert f.exists() and _mode(f) == 0o600, (f, oct(_mode(f)))
    finally:
        rec.close()
    r = runner.invoke(report_app, ["usage", "--period", period_of(now), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert sum(row["requests_total"] for row in json.loads(r.output)["rows"]) == 3
    r = runner.invoke(billing_app, ["dead-letter", "list"])
    assert r.exit_code == 0 and f"0 dead-lettered event(s) in {data / 'dead-letter.jsonl'}" in r.output
    assert not (Path.cwd() / ".kvroute").exists()  # nothing read or written beside the command


def test_an_existing_lax_ledger_is_made_private(beside_a_proxy: Path) -> None:
    data = beside_a_proxy
    data.mkdir(mode=0o700)
    (data / "billing.db").touch(mode=0o644)
    os.chmod(data / "billing.db", 0o644)
    r = runner.invoke(billing_app, ["close-period", "--period", "2026-01", "--force"])
    assert r.exit_code == 0, r.output
    assert _mode(data / "billing.db") == 0o600


def _kvroute(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvroute.plugin.cli.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


@pytest.mark.parametrize("command", [["report", "usage", "--period", "2026-10"], ["billing", "dead-letter", "list"],
                                     ["billing", "load-prices", "examples/prices.yaml"]])
def test_a_data_dir_that_is_a_file_is_one_line_naming_the_key(tmp_path: Path, command: list[str]) -> None:
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("oops")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_DATA_DIR"] = str(not_a_dir)
    if command[-1].endswith(".yaml"):
        command = [*command[:-1], str(Path(__file__).parents[2] / command[-1])]
    r = _kvroute(*command, env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: kvroute.data_dir: "), r.stderr
    assert "KVROUTE_DATA_DIR" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.e2e
def test_the_proxy_start_up_names_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    """A real LiteLLM proxy with kvroute: start-up stops on one ``kvroute: configuration error`` line naming
    ``kvroute.data_dir`` (it was a traceback from the hash secret, or billing quietly off)."""
    from kvroute.plugin.dev.child_processes import ChildStartError
    from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("oops")
    cfg = build_proxy_config([ModelGroup("llama", ["http://127.0.0.1:9/v1"])], master_key="sk-test-master")
    proxy = ProxyProcess(cfg, kvroute_settings={}, env={"KVROUTE_DATA_DIR": str(not_a_dir)},
                         inherit_kvroute_env=False, workdir=tmp_path / "proxy")
    with pytest.raises(ChildStartError):
        proxy.start()
    try:
        log = proxy.log_text()
    finally:
        proxy.stop()
    lines = [ln for ln in log.splitlines() if ln.startswith("kvroute: configuration error")]
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith("kvroute: configuration error: kvroute.data_dir: ") and "KVROUTE_DATA_DIR" in lines[0]
    assert "NotADirectoryError" not in log
