"""Sessions as the router sees them: which request is a session's first, how many a session brings, and where
each session's context was last left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Home:
    """Where a session's last answered request ran: its backend, how many whole blocks its prompt had and the
    chained key of the last (a later turn continues them), and the tokens that backend then held of the
    conversation (prompt and answer)."""

    backend: str
    blocks: int
    last_key: int
    tokens: int


class SessionHomes:
    """The ``Home`` of the last ``capacity`` sessions (least recently answered forgotten first).

    An index of whole blocks cannot tell which backend holds a session's tail (its last partial block and the
    answer): every backend holding the shared system prompt ties. ``held(key, keys, backend)`` gives the tokens
    the session's home holds of a new request whose keys continue the home's, so the policy can tell it apart.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self._homes: cachetools.LRUCache[str, Home] | None = cachetools.LRUCache(capacity) if capacity else None

    def answered(self, key: str | None, backend: str, keys: Sequence[int], tokens: int) -> None:
        if key is not None and self._homes is not None and tokens > 0:
            self._homes[key] = Home(backend, len(keys), keys[-1] if keys else 0, tokens)

    def home(self, key: str | None, keys: Sequence[int]) -> Home | None:
        """The session's home if ``keys`` continue the prompt it last answered (the same chained key at its last
        whole block: the new prompt starts with the old one), else None."""
        if key is None or self._homes is None:
            return None
        home = self._homes.get(key)
        if home is None:
            return None
        if home.blocks and (len(keys) < home.blocks or keys[home.blocks - 1] != home.last_key):
            return None
        return home

    def forget(self, backend: str) -> None:
        if self._homes is not None:
            for key in [k for k, h in self._homes.items() if h.backend == backend]:
                del self._homes[key]
