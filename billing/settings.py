"""Billing settings, declared once (pydantic-settings) and passed down.

With ``kvroute.plugin.settings`` the only modules of kvroute that read environment variables: ``LedgerSettings`` says
where the ledger lives (the proxy's settings extend it), ``config_file`` which YAML holds the ``kvroute:`` block (for
the proxy and the commands alike), the billing commands read ``BillingSettings``, a drainer process reads
``DrainSettings``, and a child process gets ``child_environment``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import AliasChoices, Field, Json, PrivateAttr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

if TYPE_CHECKING:
    from kvroute.billing.location import LedgerLocation

#: The data directory when neither ``KVROUTE_DATA_DIR`` nor ``kvroute.data_dir`` names one (proxy and commands).
DEFAULT_DATA_DIR = Path(".kvroute")
#: The variable naming the YAML that holds the ``kvroute:`` block.
CONFIG_ENV = "KVROUTE_CONFIG"
#: LiteLLM's variable naming its proxy config (what a proxy started without ``--config`` loads).
LITELLM_CONFIG_ENV = "CONFIG_FILE_PATH"


def config_file(litellm_config: str | Path | None = None) -> Path | None:
    """The YAML whose ``kvroute:`` block configures kvroute, found the same way by the proxy and by every command:
    the file ``KVROUTE_CONFIG`` names, else LiteLLM's proxy config (``litellm_config``: the file a running proxy
    loaded; else the file ``CONFIG_FILE_PATH`` names, as LiteLLM reads it); None when there is none."""
    named = os.environ.get(CONFIG_ENV) or litellm_config or os.environ.get(LITELLM_CONFIG_ENV)
    return Path(named) if named else None


class _ConfigBlock(PydanticBaseSettingsSource):
    """The ledger keys of the ``kvroute:`` block in ``config_file()`` (the YAML the proxy reads), so a command run
    with the proxy's environment finds the proxy's ledger; the environment still wins."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = config_file()
        if path is None:
            return {}
        import yaml

        from kvroute.policies.errors import ConfigError

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(CONFIG_ENV, f"cannot read {path}: {exc}") from None
        block = data.get("kvroute") if isinstance(data, dict) else None
        if not isinstance(block, dict):
            return {}
        out = {}
        for key in LedgerSettings.model_fields:
            value = block.get(key)
            if isinstance(value, str) and value.startswith("os.environ/"):
                value = os.environ.get(value[len("os.environ/"):])
            if value is not None:
                out[key] = value
        return out


class LedgerSettings(BaseSettings):
    """Where the ledger lives, declared once: ``KVROUTE_DATA_DIR``, ``KVROUTE_BILLING_DB``, ``KVROUTE_BILLING_SPOOL``
    over ``data_dir``/``billing_db``/``billing_spool`` in the ``kvroute:`` block of ``config_file()``. The proxy's
    settings extend it (reading the block themselves); the commands read it through ``BillingSettings.ledger``."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="ignore")

    data_dir: Path = Field(DEFAULT_DATA_DIR,
                           description="The proxy's data directory: embedded ledger, journal, dead letters.")
    billing_db: str | None = Field(None, description="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite path "
                                                     "(default <data dir>/billing.db; off disables the proxy's "
                                                     "billing).")
    billing_spool: Path | None = Field(None, description="Journal folder (default <data dir>/journal).")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigBlock(settings_cls))

    def ledger_location(self) -> LedgerLocation:
        """Where the ledger, journal and dead letters live (``kvroute.billing.location.ledger_location``)."""
        from kvroute.billing.location import ledger_location

        return ledger_location(self.data_dir, self.billing_db, self.billing_spool)


class BillingSettings(BaseSettings):
    """The billing commands' settings: where the ledger is (``ledger``, read when these are) and the ingest and
    period knobs, ``KVROUTE_BILLING_<FIELD>``; ``kvroute.billing.location`` resolves the ledger the way the proxy
    does."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_BILLING_", extra="ignore")

    grace_hours: float = Field(72.0, ge=0, description="Grace window after a period ends before it may close.")
    late_event_days: float = Field(35.0, gt=0, description="Ingest refuses events older than this many days.")
    future_skew_s: float = Field(300.0, ge=0, description="Ingest refuses events this far ahead of the clock.")
    _ledger: LedgerSettings = PrivateAttr(default_factory=LedgerSettings)

    @property
    def ledger(self) -> LedgerSettings:
        """The ledger's settings, as the proxy has them."""
        return self._ledger


class DrainSettings(BaseSettings):
    """A drainer process's settings: ``KVROUTE_DRAIN``, the JSON object ``kvroute.billing.drain.drain_env`` writes."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    drain: Json[dict[str, Any]] | None = Field(None, validation_alias=AliasChoices("KVROUTE_DRAIN"))


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``: what a child process (a drainer, a proxy) starts with."""
    return {**os.environ, **extra}
