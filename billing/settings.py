"""Billing settings, declared once (pydantic-settings, env prefix ``KVROUTE_BILLING_``) and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class BillingSettings(BaseSettings):
    """``KVROUTE_DATA_DIR`` (the proxy's data directory), ``KVROUTE_BILLING_DB`` (SQLAlchemy URL or SQLite file
    path, default ``<data dir>/billing.db``), ``KVROUTE_BILLING_SPOOL`` (journal folder, default ``<data
    dir>/journal``); ``kvroute.billing.location`` resolves them the way the proxy does."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_BILLING_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(Path(".kvroute"), validation_alias=AliasChoices("KVROUTE_DATA_DIR"),
                           description="The proxy's data directory: embedded ledger, journal, dead letters.")
    db: str | None = Field(None, description="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite path "
                                             "(default <data dir>/billing.db; off disables the proxy's billing).")
    spool: Path | None = Field(None, description="Journal folder (default <data dir>/journal).")
    grace_hours: float = Field(72.0, ge=0, description="Grace window after a period ends before it may close.")
    late_event_days: float = Field(35.0, gt=0, description="Ingest refuses events older than this many days.")
    future_skew_s: float = Field(300.0, ge=0, description="Ingest refuses events this far ahead of the clock.")
    batch_size: int = Field(500, ge=1, description="Events per insert batch of the recorder.")
    flush_interval_s: float = Field(0.2, gt=0, description="Longest wait before the recorder writes a batch.")
    retry_interval_s: float = Field(2.0, gt=0, description="Wait between reconnect attempts while the DB is down.")
