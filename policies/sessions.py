"""Session starts: which request is the first a router sees of its session."""

from __future__ import annotations

import cachetools


class SessionStarts:
    """Remembers the last ``capacity`` session keys seen (least recently seen forgotten first).

    ``first(key)`` is True for a key not remembered (a session's first request, or one idle so long that it was
    forgotten) and remembers it; False for a remembered key or no key. A capacity of 0 remembers nothing and
    answers False: no request is told apart as a session's first.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._seen: cachetools.LRUCache[str, None] | None = cachetools.LRUCache(capacity) if capacity else None

    def first(self, key: str | None) -> bool:
        seen = self._seen
        if key is None or seen is None:
            return False
        if key in seen:
            seen[key]  # a lookup marks it recently seen
            return False
        seen[key] = None
        return True
