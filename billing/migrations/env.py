"""Alembic environment: runs on the connection ``kvroute.billing.db`` passes in ``config.attributes``."""

from __future__ import annotations

from alembic import context

from kvroute.billing.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only ``kvroute.billing.db.migrate`` runs migrations
    raise RuntimeError("run migrations through kvroute.billing.db.migrate()")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                  compare_type=True)
with context.begin_transaction():
    context.run_migrations()
