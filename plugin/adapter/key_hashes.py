"""The ``kvroute.apps`` key map: keys kept and compared only as ``sha256:<hex>`` hashes, key hash → app.

Pure functions (no LiteLLM): the settings validate the ``apps`` block with them and ``app_keys.auth`` looks a
presented key up with ``app_of``."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

HASH_PREFIX = "sha256:"
_HEX = re.compile(r"^[0-9a-f]{64}$")


def key_hash(key: str) -> str:
    """``sha256:<hex>`` of a key (LiteLLM's own key hash, ``user_api_key_hash``, is the same hex digest)."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def hash_entries(entries: Sequence[Any]) -> list[str]:
    """Each entry as ``sha256:<hex>``: a hash kept as is, a key (from ``os.environ/NAME``) hashed; an empty entry
    (an unset variable) or a malformed hash raises ``ValueError`` naming its index."""
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"keys[{i}] is empty (an os.environ/ variable that is not set?)")
        entry = entry.strip()
        if entry.startswith(HASH_PREFIX):
            digest = entry[len(HASH_PREFIX):].lower()
            if not _HEX.match(digest):
                raise ValueError(f"keys[{i}] is not sha256:<64 hex digits>")
            out.append(HASH_PREFIX + digest)
        else:
            out.append(key_hash(entry))
    return out


def key_map(apps: Mapping[str, Any]) -> dict[str, str]:
    """key hash -> app from the validated ``kvroute.apps`` block (hashes only); a key under two apps is a
    ``ValueError``."""
    out: dict[str, str] = {}
    for app, spec in apps.items():
        for digest in spec.keys:
            other = out.setdefault(digest, app)
            if other != app:
                raise ValueError(f"one key is listed under both {other!r} and {app!r}")
    return out


def app_of(key: str, keys: Mapping[str, str]) -> str | None:
    """The app a presented key belongs to (None: not listed)."""
    return keys.get(key_hash(key))
