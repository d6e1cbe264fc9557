"""Engines for the ledger: SQLite file by default, PostgreSQL (psycopg 3) by URL; migrations run on open."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url

MIGRATIONS = Path(__file__).with_name("migrations")
_ADVISORY_KEY = 0x6B7672_0B11  # pg_advisory_xact_lock key serialising concurrent migrations
_migrated: set[str] = set()
_migrate_lock = threading.Lock()


def database_url(value: str) -> str:
    """A SQLAlchemy URL from a URL or a bare SQLite path; ``postgresql://`` gets the psycopg 3 driver."""
    if "://" not in value:
        return f"sqlite:///{Path(value).expanduser()}"
    if value.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + value.split("://", 1)[1]
    return value


def private_sqlite_file(path: Path) -> None:
    """Create the ledger file 0600 (its folder 0700 when missing) before SQLite opens it: SQLite gives the WAL
    and SHM files the mode of the database file. An existing ledger and its WAL/SHM are made 0600 too."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    for name in (str(path), f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        with contextlib.suppress(OSError):  # gone, or another user's ledger this one may only read
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine; SQLite gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` writer transactions."""
    url = database_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            private_sqlite_file(Path(parsed.database))
        engine = create_engine(url, connect_args={"timeout": 60}, **kwargs)

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if parsed.get_backend_name() == "postgresql":
        kwargs.setdefault("connect_args", {"connect_timeout": 10})  # an unreachable host fails fast → spool
    return create_engine(url, **kwargs)


def migrate(engine: Engine) -> None:
    """Run ``alembic upgrade head`` on the engine's database; safe when several processes start at once."""
    from alembic import command
    from alembic.config import Config

    key = str(engine.url)
    with _migrate_lock:
        if key in _migrated:
            return
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_KEY})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        _migrated.add(key)


def open_engine(url: str, **kwargs: Any) -> Engine:
    """``make_engine`` + ``migrate``: the way every entry point opens the ledger."""
    engine = make_engine(url, **kwargs)
    try:
        migrate(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine
