"""One settings story: only the settings modules read the environment, every billing field has a reader, and the
proxy's settings and the billing commands' settings resolve the same ledger."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvroute.billing.location import location_from
from kvroute.billing.settings import BillingSettings, DrainSettings, config_file
from kvroute.plugin.settings import CliSettings, KvrouteSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
READERS = {"plugin/settings.py", "billing/settings.py"}
ENV_READ = re.compile(r"os\.environ(?!/)|getenv\(|envvar=")


def test_only_the_settings_modules_read_the_environment():
    offenders = []
    for room in ("plugin", "billing", "sim", "policies"):
        for path in sorted((ROOT / room).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in READERS:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if ENV_READ.search(line) and "os.environ.setdefault" not in line:
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "read the environment in a settings class and pass the value down:\n" + "\n".join(offenders)


def test_every_billing_setting_has_a_reader():
    sources = "\n".join(p.read_text() for room in ("billing", "plugin") for p in (ROOT / room).rglob("*.py")
                        if p.name != "settings.py")
    unread = [name for name in BillingSettings.model_fields if not re.search(rf"\.{name}\b", sources)]
    assert not unread


def test_proxy_and_commands_resolve_one_ledger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for env in ({}, {"KVROUTE_DATA_DIR": str(tmp_path / "d")}, {"KVROUTE_BILLING_DB": "l.db"},
                {"KVROUTE_BILLING_SPOOL": "j", "KVROUTE_DATA_DIR": "rel"}):
        for name in ("KVROUTE_DATA_DIR", "KVROUTE_BILLING_DB", "KVROUTE_BILLING_SPOOL"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert KvrouteSettings().ledger_location() == location_from(BillingSettings()), env


def test_commands_read_the_ledger_keys_of_the_proxys_yaml(tmp_path, monkeypatch):
    """A proxy configured by ``KVROUTE_CONFIG`` with ``data_dir``/``billing_db``/``billing_spool`` in its
    ``kvroute:`` block: ``kvroute report``/``billing`` (BillingSettings) find the same ledger; env still wins."""
    monkeypatch.chdir(tmp_path)
    for name in ("KVROUTE_DATA_DIR", "KVROUTE_BILLING_DB", "KVROUTE_BILLING_SPOOL"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "proxy.yaml"
    config.write_text("kvroute:\n  data_dir: data\n  billing_spool: os.environ/SPOOL_DIR\n")
    monkeypatch.setenv("KVROUTE_CONFIG", str(config))
    monkeypatch.setenv("SPOOL_DIR", str(tmp_path / "spool"))
    proxy = load_settings().ledger_location()
    assert proxy.data_dir == tmp_path / "data" and proxy.journal == tmp_path / "spool"
    assert location_from(BillingSettings()) == proxy
    monkeypatch.setenv("KVROUTE_DATA_DIR", str(tmp_path / "env"))
    assert location_from(BillingSettings()) == load_settings().ledger_location()
    assert location_from(BillingSettings()).data_dir == tmp_path / "env"


def test_proxy_and_commands_find_the_config_the_same_way(tmp_path, monkeypatch):
    """One function finds the ``kvroute:`` block for the proxy and the commands: ``KVROUTE_CONFIG``'s file, else
    LiteLLM's own config (the file the proxy loaded; for a command, the file LiteLLM's ``CONFIG_FILE_PATH`` names)."""
    monkeypatch.chdir(tmp_path)
    for name in ("KVROUTE_DATA_DIR", "KVROUTE_BILLING_DB", "KVROUTE_BILLING_SPOOL", "KVROUTE_CONFIG",
                 "CONFIG_FILE_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert config_file() is None
    litellm = tmp_path / "config.yaml"
    litellm.write_text("model_list: []\nkvroute:\n  data_dir: from-litellm\n")
    assert config_file(litellm) == litellm
    monkeypatch.setenv("CONFIG_FILE_PATH", str(litellm))
    assert config_file() == litellm
    proxy = load_settings(litellm).ledger_location()  # the proxy passes the config it loaded
    assert proxy.data_dir == tmp_path / "from-litellm"
    assert location_from(BillingSettings()) == proxy == load_settings().ledger_location()
    own = tmp_path / "kvroute.yaml"
    own.write_text("kvroute:\n  data_dir: from-kvroute\n")
    monkeypatch.setenv("KVROUTE_CONFIG", str(own))
    assert config_file(litellm) == own
    assert location_from(BillingSettings()) == load_settings(litellm).ledger_location()
    assert location_from(BillingSettings()).data_dir == tmp_path / "from-kvroute"


@pytest.mark.parametrize(("value", "debug"), [("1", True), ("yes", True), ("TRUE", True), ("0", False),
                                              ("nonsense", False)])
def test_cli_settings(monkeypatch, tmp_path, value, debug):
    monkeypatch.setenv("KVROUTE_DEBUG", value)
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-master")
    s = CliSettings()
    assert s.debug is debug and s.cache_dir == tmp_path and s.master_key.get_secret_value() == "sk-master"


def test_drain_settings(monkeypatch):
    monkeypatch.delenv("KVROUTE_DRAIN", raising=False)
    assert DrainSettings().drain is None
    monkeypatch.setenv("KVROUTE_DRAIN", '{"db": "sqlite://"}')
    assert DrainSettings().drain == {"db": "sqlite://"}
