"""Billing settings, declared once (pydantic-settings, env prefix ``KVROUTE_BILLING_``) and passed down.

With ``kvroute.plugin.settings`` the only modules of kvroute that read environment variables: the billing commands
read ``BillingSettings``, a drainer process reads ``DrainSettings``, and a child process gets ``child_environment``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, Json
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

#: The data directory when neither ``KVROUTE_DATA_DIR`` nor ``kvroute.data_dir`` names one (proxy and commands).
DEFAULT_DATA_DIR = Path(".kvroute")


#: ``kvroute:`` block keys of the proxy's settings that say where the ledger is → this class's fields.
LEDGER_KEYS = {"data_dir": "data_dir", "billing_db": "db", "billing_spool": "spool"}


class _ProxyBlock(PydanticBaseSettingsSource):
    """The ledger keys of the ``kvroute:`` block in the YAML named by ``KVROUTE_CONFIG`` (what the proxy reads),
    so a command run with the proxy's environment finds the proxy's ledger; the environment still wins."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("KVROUTE_CONFIG")
        if not path:
            return {}
        import yaml

        from kvroute.policies.errors import ConfigError

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("KVROUTE_CONFIG", f"cannot read {path}: {exc}") from None
        block = data.get("kvroute") if isinstance(data, dict) else None
        if not isinstance(block, dict):
            return {}
        out = {}
        for key, name in LEDGER_KEYS.items():
            value = block.get(key)
            if isinstance(value, str) and value.startswith("os.environ/"):
                value = os.environ.get(value[len("os.environ/"):])
            if value is not None:
                out[name] = value
        return out


class BillingSettings(BaseSettings):
    """``KVROUTE_DATA_DIR`` (the proxy's data directory), ``KVROUTE_BILLING_DB`` (SQLAlchemy URL or SQLite file
    path, default ``<data dir>/billing.db``), ``KVROUTE_BILLING_SPOOL`` (journal folder, default ``<data
    dir>/journal``), over ``data_dir``/``billing_db``/``billing_spool`` in the ``kvroute:`` block of
    ``KVROUTE_CONFIG`` as the proxy reads them; ``kvroute.billing.location`` resolves them the way the proxy does."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_BILLING_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(DEFAULT_DATA_DIR, validation_alias=AliasChoices("KVROUTE_DATA_DIR"),
                           description="The proxy's data directory: embedded ledger, journal, dead letters.")
    db: str | None = Field(None, description="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite path "
                                             "(default <data dir>/billing.db; off disables the proxy's billing).")
    spool: Path | None = Field(None, description="Journal folder (default <data dir>/journal).")
    grace_hours: float = Field(72.0, ge=0, description="Grace window after a period ends before it may close.")
    late_event_days: float = Field(35.0, gt=0, description="Ingest refuses events older than this many days.")
    future_skew_s: float = Field(300.0, ge=0, description="Ingest refuses events this far ahead of the clock.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ProxyBlock(settings_cls))


class DrainSettings(BaseSettings):
    """A drainer process's settings: ``KVROUTE_DRAIN``, the JSON object ``kvroute.billing.drain.drain_env`` writes."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    drain: Json[dict[str, Any]] | None = Field(None, validation_alias=AliasChoices("KVROUTE_DRAIN"))


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``: what a child process (a drainer, a proxy) starts with."""
    return {**os.environ, **extra}
