"""Billing settings, declared once (pydantic-settings, env prefix ``KVROUTE_BILLING_``) and passed down.

With ``kvroute.plugin.settings`` the only modules of kvroute that read environment variables: the billing commands
read ``BillingSettings``, a drainer process reads ``DrainSettings``, and a child process gets ``child_environment``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, Json
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The data directory when neither ``KVROUTE_DATA_DIR`` nor ``kvroute.data_dir`` names one (proxy and commands).
DEFAULT_DATA_DIR = Path(".kvroute")


class BillingSettings(BaseSettings):
    """``KVROUTE_DATA_DIR`` (the proxy's data directory), ``KVROUTE_BILLING_DB`` (SQLAlchemy URL or SQLite file
    path, default ``<data dir>/billing.db``), ``KVROUTE_BILLING_SPOOL`` (journal folder, default ``<data
    dir>/journal``); ``kvroute.billing.location`` resolves them the way the proxy does."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_BILLING_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(DEFAULT_DATA_DIR, validation_alias=AliasChoices("KVROUTE_DATA_DIR"),
                           description="The proxy's data directory: embedded ledger, journal, dead letters.")
    db: str | None = Field(None, description="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite path "
                                             "(default <data dir>/billing.db; off disables the proxy's billing).")
    spool: Path | None = Field(None, description="Journal folder (default <data dir>/journal).")
    grace_hours: float = Field(72.0, ge=0, description="Grace window after a period ends before it may close.")
    late_event_days: float = Field(35.0, gt=0, description="Ingest refuses events older than this many days.")
    future_skew_s: float = Field(300.0, ge=0, description="Ingest refuses events this far ahead of the clock.")


class DrainSettings(BaseSettings):
    """A drainer process's settings: ``KVROUTE_DRAIN``, the JSON object ``kvroute.billing.drain.drain_env`` writes."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    drain: Json[dict[str, Any]] | None = Field(None, validation_alias=AliasChoices("KVROUTE_DRAIN"))


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``: what a child process (a drainer, a proxy) starts with."""
    return {**os.environ, **extra}
