"""Fixtures: a SQLite file per test, and PostgreSQL -- ``KVROUTE_TEST_PG_URL`` if set, else a throw-away server."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_BIN_DIRS = ("/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> Path | None:
    for d in PG_BIN_DIRS:
        if Path(d, "initdb").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class _PgServer:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (run as user ``postgres`` when we are root)."""

    def __init__(self) -> None:
        self.bin = _pg_bin()
        if self.bin is None:
            raise RuntimeError("no initdb/pg_ctl found (install postgresql or set KVROUTE_TEST_PG_URL)")
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and no 'postgres' user to run the server as") from None
            self.user = "postgres"
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if self.user:
            shutil.chown(self.dir, self.user)

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = list(args)
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)

    def start(self) -> None:
        r = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync", "-E", "UTF8")
        if r.returncode:
            raise RuntimeError(f"initdb failed: {r.stderr[-500:]}")
        self.pg_ctl("start")

    def pg_ctl(self, action: str) -> None:
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off "
                "-c full_page_writes=off -c max_connections=60")
        args = [str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60"]
        if action == "start":
            args += ["-o", opts, "-l", str(self.dir / "log"), "start"]
        else:
            args += ["-m", "fast", action]
        r = self._run(*args)
        if r.returncode:
            log = (self.dir / "log").read_text()[-800:] if (self.dir / "log").exists() else ""
            raise RuntimeError(f"pg_ctl {action} failed: {r.stderr[-500:]} {log}")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.pg_ctl("stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """An admin URL of a PostgreSQL server for the session; skips with the reason when none can be had."""
    url = os.environ.get("KVROUTE_TEST_PG_URL")
    if url:
        from kvroute.billing.db import database_url
        yield database_url(url)
        return
    try:
        server = _PgServer()
        server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"PostgreSQL unavailable: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh database on the session's PostgreSQL server, dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url
    name = f"kvb_{uuid.uuid4().hex[:12]}"
    admin = make_url(pg_admin_url)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'billing.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using it runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'billing.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(autouse=True)
def _fresh_migration_cache() -> Iterator[None]:
    yield
    from kvroute.billing import db
    db._migrated.clear()
