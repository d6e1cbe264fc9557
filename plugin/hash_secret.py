"""Where the server-side hash secret comes from: settings, else Redis (shared by every worker), else a file.

Order: ``hash_secret`` (``KVROUTE_HASH_SECRET``) as given; with ``redis_url`` the secret in
``<namespace>:hash_secret`` (the first worker ever to start stores a random one with SET NX, so all workers and
restarts agree); otherwise ``<data_dir>/hash_secret`` (32 random bytes, created once with mode 0600). When Redis
is configured but unreachable at startup the file is used and a warning says so: workers on other hosts may then
key their chains differently (they route on their own state) until they restart with Redis up.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import ChainKey

log = logging.getLogger("kvroute.plugin")
SECRET_BYTES = 32
SECRET_FILE = "hash_secret"


def file_secret(data_dir: Path) -> bytes:
    """The secret in ``data_dir/hash_secret``; created once (0600, O_EXCL) when missing, read back otherwise."""
    path = Path(data_dir) / SECRET_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another worker created it a moment ago
        return _read(path)
    except OSError as exc:
        raise ConfigError("kvroute.data_dir", f"cannot create {path}: {exc}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(SECRET_BYTES))
        f.flush()
        os.fsync(f.fileno())
    return _read(path)


def _read(path: Path) -> bytes:
    for _ in range(50):  # a concurrent creator may not have written it yet
        data = path.read_bytes()
        if len(data) >= SECRET_BYTES:
            return data
        time.sleep(0.01)
    raise ConfigError("kvroute.data_dir", f"{path} holds no usable secret (delete it to generate a new one)")


def resolve_chain_key(secret: str | None, redis_url: str | None, data_dir: Path,
                      share: Callable[[str, bytes], bytes] | None = None) -> tuple[ChainKey, str]:
    """The ``ChainKey`` every chain of this proxy is keyed with, and where its secret came from."""
    if secret:
        return ChainKey(secret.encode("utf-8")), "settings"
    if redis_url and share is not None:
        candidate = secrets.token_bytes(SECRET_BYTES)
        try:
            return ChainKey(share(redis_url, candidate)), "redis"
        except OSError as exc:
            log.warning("kvroute: cannot share the hash secret through Redis (%s); using %s", exc,
                        Path(data_dir) / SECRET_FILE)
    return ChainKey(file_secret(data_dir)), "file"
