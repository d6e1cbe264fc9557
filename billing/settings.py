"""Billing settings, declared once (pydantic-settings, env prefix ``KVROUTE_BILLING_``) and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class BillingSettings(BaseSettings):
    """``KVROUTE_BILLING_DB`` (SQLAlchemy URL or SQLite file path), ``KVROUTE_BILLING_SPOOL`` (spool folder)."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_BILLING_", extra="ignore")

    db: str = Field(".kvroute/billing.db", description="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite path.")
    spool: Path = Field(Path(".kvroute/spool"), description="Folder of the durable spool used while the DB is down.")
    grace_hours: float = Field(72.0, ge=0, description="Grace window after a period ends before it may close.")
    late_event_days: float = Field(35.0, gt=0, description="Ingest refuses events older than this many days.")
    future_skew_s: float = Field(300.0, ge=0, description="Ingest refuses events this far ahead of the clock.")
    batch_size: int = Field(500, ge=1, description="Events per insert batch of the recorder.")
    flush_interval_s: float = Field(0.2, gt=0, description="Longest wait before the recorder writes a batch.")
    retry_interval_s: float = Field(2.0, gt=0, description="Wait between reconnect attempts while the DB is down.")
