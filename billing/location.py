"""Where the ledger lives: one resolution of the data directory, the ledger URL, the journal and the dead letters.

The proxy (``kvroute.plugin.adapter.billing_feed``), ``kvroute report``, ``kvroute billing`` and ``kvroute billing
dead-letter`` all call ``ledger_location`` with the same settings (``KVROUTE_DATA_DIR``, ``KVROUTE_BILLING_DB``,
``KVROUTE_BILLING_SPOOL``, over ``data_dir``/``billing_db``/``billing_spool`` in the ``kvroute:`` block of the
file ``kvroute.billing.settings.config_file`` finds), so a report run beside a proxy reads the ledger that proxy
writes: ``KVROUTE_BILLING_DB`` when set, else ``<data dir>/billing.db``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.policies.errors import ConfigError

#: ``KVROUTE_BILLING_DB`` values that turn billing off.
OFF = ("off", "none", "false", "0", "disabled")
#: The key a bad data directory is reported under (the YAML key; the variable is named in the message).
DATA_DIR_KEY = "kvroute.data_dir"
LEDGER_FILE = "billing.db"
JOURNAL_DIR = "journal"


@dataclass(frozen=True)
class LedgerLocation:
    """The data directory, the ledger's SQLAlchemy URL (``None``: billing off), the journal folder, and the
    folder of ``dead-letter.jsonl`` (the data directory)."""

    data_dir: Path
    db_url: str | None
    journal: Path

    @property
    def dead_letters(self) -> Path:
        return self.data_dir


def ledger_location(data_dir: str | Path, db: str | None = None, spool: str | Path | None = None) -> LedgerLocation:
    """Resolve the ledger from the settings: ``db`` (a URL or a SQLite path, or ``off``) else ``<data_dir>/billing.db``;
    the journal is ``spool`` else ``<data_dir>/journal``. SQLite paths become absolute (a drainer process or a
    report in another folder opens the same file). Raises ``ConfigError`` when ``data_dir`` is not a folder."""
    data = Path(os.path.abspath(Path(data_dir).expanduser()))
    check_data_dir(data)
    setting = (db or "").strip()
    if setting.lower() in OFF and setting:
        url = None
    elif setting and "://" in setting:
        from kvroute.billing.db import database_url
        url = database_url(setting)
    elif setting:
        url = f"sqlite:///{os.path.abspath(Path(setting).expanduser())}"
    else:
        url = f"sqlite:///{data / LEDGER_FILE}"
    journal = Path(os.path.abspath(Path(spool).expanduser())) if spool else data / JOURNAL_DIR
    return LedgerLocation(data, url, journal)


def location_from(settings: Any) -> LedgerLocation:
    """``ledger_location`` of a ``BillingSettings`` (its ``ledger``: the proxy's ``LedgerSettings``)."""
    return settings.ledger.ledger_location()


def check_data_dir(data_dir: str | Path) -> None:
    """A data directory that exists must be a folder (one line naming the key, never a traceback later)."""
    data = Path(data_dir).expanduser()
    if data.exists() and not data.is_dir():
        raise ConfigError(DATA_DIR_KEY, f"{data} is not a directory (KVROUTE_DATA_DIR / kvroute.data_dir: "
                                        "point it at a folder kvroute may create)")


def prepare_data_dir(data: str | Path) -> Path:
    """Create the data directory private (0700) when missing and check that it is a writable folder; raises
    ``ConfigError`` naming ``kvroute.data_dir`` otherwise. An existing folder keeps its mode."""
    path = Path(os.path.abspath(Path(data).expanduser()))
    check_data_dir(path)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(DATA_DIR_KEY, f"cannot create {path} ({exc.strerror or exc}; KVROUTE_DATA_DIR / "
                                        "kvroute.data_dir)") from None
    check_data_dir(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(DATA_DIR_KEY, f"{path} is not writable by this user (KVROUTE_DATA_DIR / kvroute.data_dir)")
    return path
