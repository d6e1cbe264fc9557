"""Where the server-side hash secret comes from, and the fingerprint instances compare it by.

Order: ``hash_secret`` (``KVROUTE_HASH_SECRET``, or ``os.environ/NAME`` in the YAML) as given; else the file
named by ``hash_secret_file``; else, only when no ``redis_url`` shares state, ``<data_dir>/hash_secret``
(32 random bytes, created once with mode 0600: the workers of one proxy share its data directory).

With ``redis_url`` and neither setting, start-up stops with one line naming ``kvroute.hash_secret``: the secret
is never stored in the Redis that holds the keys it protects (whoever reads that Redis would get both), and a
secret each instance generated for itself would split the fleet. Instances compare secrets through
``fingerprint``: a slow keyed digest of a constant that confirms agreement and reveals nothing usable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from pathlib import Path

from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import ChainKey

log = logging.getLogger("kvroute.plugin")
SECRET_BYTES = 32
SECRET_FILE = "hash_secret"
MIN_SECRET_BYTES = 16
_FINGERPRINT_SALT = b"kvroute-hash-secret-fingerprint-v1"
_FINGERPRINT_ROUNDS = 200_000  # a guessed passphrase costs this many HMACs per try (~0.1 s here)


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


def named_file_secret(path: Path) -> bytes:
    """The secret in the operator's ``hash_secret_file`` (one trailing newline ignored; >= 16 bytes)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("kvroute.hash_secret_file", f"cannot read {path}: {exc.strerror or exc}") from None
    data = data[:-1] if data.endswith(b"\n") else data
    data = data[:-1] if data.endswith(b"\r") else data
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError("kvroute.hash_secret_file", f"{path} holds {len(data)} bytes; a secret needs at least "
                                                      f"{MIN_SECRET_BYTES}")
    return data


def resolve_chain_key(secret: str | None, redis_url: str | None, data_dir: Path,
                      secret_file: Path | None = None) -> tuple[ChainKey, str]:
    """The ``ChainKey`` every chain of this proxy is keyed with, and where its secret came from (``settings``,
    ``secret_file`` or ``file``). Raises ``ConfigError`` when instances share state and no secret is given."""
    if secret:
        return ChainKey(secret.encode("utf-8")), "settings"
    if secret_file is not None:
        return ChainKey(named_file_secret(secret_file)), "secret_file"
    if redis_url:
        raise ConfigError("kvroute.hash_secret", "required with redis_url (instances must share one secret and it "
                                                 "is never stored in Redis): set hash_secret, os.environ/NAME or "
                                                 "hash_secret_file")
    return ChainKey(file_secret(data_dir)), "file"


def fingerprint(key: ChainKey) -> str:
    """16 hex digits that are equal exactly when two instances hold the same secret (PBKDF2-HMAC-SHA256 of a
    constant, salted and slow: publishing it confirms agreement without helping anyone guess the secret)."""
    if not key.keyed:
        return "unkeyed"
    return hashlib.pbkdf2_hmac("sha256", key.secret, _FINGERPRINT_SALT, _FINGERPRINT_ROUNDS, dklen=8).hex()
