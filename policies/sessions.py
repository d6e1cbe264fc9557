"""Sessions as the router sees them: which request is a session's first, how many a session brings, and where
each session's context was last left."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import cachetools

from kvroute.policies.return_gap import ReturnGap


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


@dataclass(slots=True)
class _Live:
    backend: str
    tokens: int  # the conversation's context there (prompt, and the answer once answered)
    at: float  # when its last turn was sent or ended
    pending: bool  # that turn is still running


GROWTH_ALPHA = 0.25  # weight of each later turn in its prefix's mean context
FORGOTTEN = 0.01  # a session worth less than this is dropped


class LiveSessions:
    """Which backend holds each session's context, and how big the sessions starting with a prefix grow.

    ``sent`` records a turn on the backend it went to (a session lives where its last turn went), ``ended`` that
    it ended there. A session is worth its context as ``ReturnGap`` weighs a held context (whole while its turn
    runs, then halved every learned gap to a session's next turn, at most ``half_life_s``), and is forgotten
    below 1 %. ``at_risk`` is what a backend holds of live sessions beyond a prefix they share; ``growth`` the
    context later turns of sessions starting with a prefix reach (a decayed mean of their prompts). Both are in
    the index's tokens; the newest ``capacity`` sessions are kept.
    """

    def __init__(self, capacity: int = 65536, half_life_s: float = 60.0, prefixes: int = 4096) -> None:
        if capacity < 0 or not half_life_s > 0 or prefixes < 1:
            raise ValueError("capacity >= 0, half_life_s > 0 and prefixes >= 1 required")
        self.capacity = capacity
        self.gap = ReturnGap(half_life_s)
        self._live: OrderedDict[str, _Live] = OrderedDict()  # least recently sent first
        self._on: dict[str, dict[str, _Live]] = {}  # backend -> its sessions
        self._growth: cachetools.LRUCache[int, float] = cachetools.LRUCache(prefixes)

    def sent(self, key: str | None, root: int, backend: str, tokens: int, now: float) -> None:
        """A turn of session ``key`` (its prompt's first block ``root``, ``tokens`` long) went to ``backend``."""
        if key is None or not self.capacity:
            return
        live = self._live.pop(key, None)
        if live is not None:
            self._on[live.backend].pop(key, None)
            if tokens > live.tokens:  # a later turn (not a retry or hedge of the same prompt): it came back,
                if not live.pending:  # and shows how big this prefix's sessions grow
                    self.gap.note(now - live.at)
                mean = self._growth.get(root)
                self._growth[root] = float(tokens) if mean is None else mean + GROWTH_ALPHA * (tokens - mean)
        live = _Live(backend, tokens, now, True)
        self._live[key] = live
        self._on.setdefault(backend, {})[key] = live
        while len(self._live) > self.capacity:
            old_key, old = self._live.popitem(last=False)
            self._on[old.backend].pop(old_key, None)

    def ended(self, key: str | None, backend: str, now: float) -> None:
        """Session ``key``'s turn on ``backend`` ended (answered, failed or cut)."""
        live = self._live.get(key) if key is not None else None
        if live is not None and live.backend == backend:
            live.pending, live.at = False, now

    def answered(self, key: str | None, backend: str, tokens: int) -> None:
        """Session ``key``'s turn on ``backend`` was answered: its context there is ``tokens`` (prompt and answer)."""
        live = self._live.get(key) if key is not None else None
        if live is not None and live.backend == backend and tokens > 0:
            live.tokens = tokens

    def at_risk(self, backend: str, shared: float, now: float) -> float:
        """Tokens of the live sessions on ``backend`` beyond their first ``shared`` (a prefix a new prompt shares
        with them), each weighed by its worth; forgets the sessions no longer worth counting."""
        on = self._on.get(backend)
        if not on:
            return 0.0
        gap = self.gap
        half = gap.half_life_s
        total = 0.0
        gone = []
        for key, live in on.items():
            worth = gap.worth(now - live.at, live.pending, half)
            if worth < FORGOTTEN:
                gone.append(key)
            elif live.tokens > shared:
                total += worth * (live.tokens - shared)
        for key in gone:
            del on[key]
            self._live.pop(key, None)
        return total

    def growth(self, root: int) -> float:
        """The mean context of later turns of sessions whose prompt starts with block ``root`` (0: none seen)."""
        return self._growth.get(root, 0.0)

    def forget(self, backend: str) -> None:
        """``backend`` left the fleet: the sessions that lived there are gone with it."""
        for key in self._on.pop(backend, {}):
            self._live.pop(key, None)
