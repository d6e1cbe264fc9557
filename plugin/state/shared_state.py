"""Prefix index, in-flight load and breaker state shared by proxy workers through Redis.

Design (chosen for decision latency): the request path never waits on Redis. Every worker keeps the full
local ``PrefixIndex``/``LoadTracker``/``HealthBoard`` and answers ``match``/``view``/``available`` from
memory (no extra latency vs one worker; ``bench/shared_state_bench.py`` measures it against a read-through
design that costs a Redis round trip per pick). Writes are queued and a background thread
(one per worker, one connection) every ``flush_interval_s``:

- appends this worker's index updates (record/confirm/forget/...) to the stream ``<ns>:prefix`` and
  applies the other workers' updates from it (so all agree within tens of milliseconds);
- writes this worker's in-flight counts per backend to ``<ns>:load:<worker>`` (TTL ``worker_ttl_s``) and
  sums everybody else's into the local view (a dead worker's load vanishes with its key);
- publishes breaker openings and probe-confirmed closings to ``<ns>:health`` (latest per backend also in
  the hash ``<ns>:breakers`` for late joiners); followers adopt them, waiting ``follower_grace_s`` longer
  than the opener before probing, so normally the opener's probe is the only one;
- writes its status to ``<ns>:status:<worker>`` (TTL ``worker_ttl_s``) every heartbeat: the plugin's counters,
  its replication lag, the fingerprint of its hash secret (a live worker with another one is logged, listed in
  ``secret_mismatch`` and its index updates are not applied) and what others asked it to ``publish`` (the
  hybrid guard's counts and TTFT samples); ``peer_published`` reads the others'.

Every key is under ``namespace``; the long-lived ones expire ``key_ttl_s`` after the last heartbeat touched them.
The hash secret is never written here (``kvroute.plugin.state.hash_secret``); one an older kvroute left at
``<ns>:hash_secret`` is deleted on connect.

When Redis is down each worker routes on its local state (no exception reaches the request path), the
queue keeps the newest ``max_outbox`` updates, and the thread reconnects with jittered exponential
backoff; on return it flushes the queue, reads what it missed and re-publishes its open breakers. The
prefix stream keeps ``stream_retention_s`` of history (Redis memory ≈ update rate × that window).

A Redis that comes back empty (restarted without persistence, flushed) is told from a brief outage by the
deployment's epoch marker ``<ns>:epoch``: the first worker to reconnect writes a new one and re-seeds the
prefix stream with the newest ``reseed_blocks`` keys per backend of its local index (every worker holds the
same index, so one seeder suffices), so a worker that starts after the restart learns what was known before.
Replication lag (Redis append of an entry to its application here, from the stream entry's id) is kept for
the last ``lag_samples`` entries: ``replication()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.policies.health import BreakerConfig, BreakerState, HealthBoard, Transition
from kvroute.policies.load import BackendLoad, LoadTracker
from kvroute.policies.prefix_index import LocatorParts, PrefixIndex, PrefixIndexConfig

log = logging.getLogger("kvroute.shared_state")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """Knobs of the Redis link; ``namespace`` prefixes every key (one per deployment)."""

    namespace: str = "kvroute"
    flush_interval_s: float = 0.02
    heartbeat_s: float = 0.5
    worker_ttl_s: float = 3.0
    stream_retention_s: float = 60.0
    stream_maxlen: int = 20_000
    max_batch_ops: int = 256
    max_outbox: int = 50_000
    bootstrap_entries: int = 5_000
    max_pending_per_group: int = 50_000
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    socket_timeout_s: float = 1.0
    guard_timeout_s: float = 0.25  # the hosted path's reservation: answer or fall back to the local share
    follower_grace_s: float = 10.0
    key_ttl_s: float = 86_400.0  # every long-lived key expires a day after the last instance touched it
    reseed_blocks: int = 100_000
    reseed_chunk: int = 512
    lag_samples: int = 2_048

    def __post_init__(self) -> None:
        for name in ("flush_interval_s", "heartbeat_s", "worker_ttl_s", "backoff_min_s", "backoff_max_s",
                     "socket_timeout_s", "stream_retention_s", "guard_timeout_s", "key_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("stream_maxlen", "max_batch_ops", "max_outbox", "bootstrap_entries", "max_pending_per_group",
                     "reseed_blocks", "reseed_chunk", "lag_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if self.follower_grace_s < 0:
            raise ValueError("follower_grace_s must be >= 0")
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise ValueError("namespace must be a non-empty word")


class SharedPrefixIndex(LocatorParts):
    """A ``PrefixLocator``: local ``PrefixIndex`` for reads, updates also queued for the other workers."""

    def __init__(self, shared: SharedState, group: str, config: PrefixIndexConfig | None = None) -> None:
        self._shared = shared
        self.group = group
        self.local = PrefixIndex(config)
        self.config = self.local.config
        self._lock = threading.Lock()

    # --- reads (hot path, memory only) ----------------------------------------------------------
    def match(self, keys: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        with self._lock:
            return self.local.match(keys, backends, now)

    def blocks(self, backend: str | None = None) -> int:
        with self._lock:
            return self.local.blocks(backend)

    def backends(self) -> list[str]:
        with self._lock:
            return self.local.backends()

    def accuracy(self, backend: str) -> float | None:
        with self._lock:
            return self.local.accuracy(backend)

    def capacity_blocks(self, backend: str) -> int:
        with self._lock:
            return self.local.capacity_blocks(backend)

    # --- writes: applied locally, then shared ---------------------------------------------------
    def record(self, backend: str, keys: Sequence[int], now: float) -> None:
        with self._lock:
            self.local.record(backend, keys, now)
        if keys:
            self._shared._queue_index(self.group, ("r", backend, _as_list(keys)))

    def confirm(self, backend: str, keys: Sequence[int], cached_blocks: int, now: float,
                predicted_blocks: int | None = None) -> None:
        with self._lock:
            self.local.confirm(backend, keys, cached_blocks, now, predicted_blocks)
        self._shared._queue_index(self.group, ("c", backend, _as_list(keys), int(cached_blocks),
                                               -1 if predicted_blocks is None else int(predicted_blocks)))

    def forget(self, backend: str, keys: Sequence[int], computed_blocks: int = 0) -> None:
        with self._lock:
            self.local.forget(backend, keys, computed_blocks)
        if keys:
            self._shared._queue_index(self.group, ("f", backend, _as_list(keys), int(computed_blocks)))

    def remove_backend(self, backend: str) -> None:
        with self._lock:
            self.local.remove_backend(backend)
        self._shared._queue_index(self.group, ("x", backend))

    def set_capacity(self, backend: str, capacity_tokens: int) -> None:
        """Capacity comes from each worker's own config, so it is not shared."""
        with self._lock:
            self.local.set_capacity(backend, capacity_tokens)

    def retain(self, live: Iterable[str]) -> list[str]:
        with self._lock:
            gone = self.local.retain(live)
        for b in gone:
            self._shared._queue_index(self.group, ("x", b))
        return gone

    def snapshot_ops(self, max_blocks: int, chunk: int) -> list[tuple[Any, ...]]:
        """Record ops that rebuild this index elsewhere: per backend its newest ``max_blocks`` keys, replayed
        oldest first in chunks of ``chunk`` (each chunk reversed, as ``record`` inserts deepest first)."""
        ops: list[tuple[Any, ...]] = []
        with self._lock:
            held = {b: list(s.entries) for b, s in self.local._backends.items()}
        for backend, keys in held.items():
            keys = keys[-max_blocks:]
            for i in range(0, len(keys), chunk):
                ops.append(("r", backend, keys[i:i + chunk][::-1]))
        return ops

    # --- remote updates (sync thread) -----------------------------------------------------------
    def apply(self, op: Sequence[Any], now: float) -> None:
        kind, backend = op[0], str(op[1])
        with self._lock:
            if kind == "r":
                self.local.record(backend, op[2], now)
            elif kind == "c":
                self.local.confirm(backend, op[2], int(op[3]), now, None if op[4] < 0 else int(op[4]))
            elif kind == "f":  # an op without the count is from a worker that sent only the keys to drop
                self.local.forget(backend, op[2], int(op[3]) if len(op) > 3 else 0)
            elif kind == "x":
                self.local.remove_backend(backend)


class SharedLoadTracker(LoadTracker):
    """``LoadTracker`` whose views add the other workers' in-flight counts (heartbeat, TTL-bounded)."""

    def __init__(self, shared: SharedState, group: str, half_life_s: float = 2.0) -> None:
        super().__init__(half_life_s)
        self._shared = shared
        self.group = group
        # backend -> (in-flight, prefill tokens, last pick on this worker's clock); replaced wholesale by
        # the sync thread, and emptied when heartbeats stop succeeding (the hot path only does dict gets).
        self._remote: dict[str, tuple[int, int, float]] = {}
        # backend -> when another worker's pick of it (its index record) was applied here: the least recently
        # used order of cold picks sees the fleet's picks within the replication lag, not a heartbeat later.
        self._seen_picks: dict[str, float] = {}

        # backend -> the other workers' busy seconds (summed, as of ``_remote_busy_at``): the hot-spot bound and
        # cold placement weigh the fleet's recent work, not the 1/N of it this worker assigned.
        self._remote_busy: dict[str, float] = {}
        self._remote_busy_at = 0.0

    def saw_remote_pick(self, backend: str, now: float) -> None:
        self._seen_picks[backend] = now

    def local_busy(self, now: float) -> dict[str, float]:
        """This worker's own busy seconds per backend at ``now`` (read by the sync thread)."""
        return {b: v for b, v in zip(list(self._busy), LoadTracker.busy_many(self, list(self._busy), now),
                                     strict=True) if v > 1e-6}

    def set_remote_busy(self, busy: dict[str, float], at: float) -> None:
        self._remote_busy, self._remote_busy_at = busy, at

    def busy(self, backend: str, now: float) -> float:
        own = super().busy(backend, now)
        r = self._remote_busy.get(backend)
        if not r:
            return own
        return own + r * math.pow(0.5, max(0.0, now - self._remote_busy_at) / self.busy_half_life_s)

    def busy_many(self, backends: Sequence[str], now: float) -> list[float]:
        own = super().busy_many(backends, now)
        remote = self._remote_busy
        if not remote:
            return own
        k = math.pow(0.5, max(0.0, now - self._remote_busy_at) / self.busy_half_life_s)
        return [v + remote.get(b, 0.0) * k for v, b in zip(own, backends, strict=True)]

    def local_counts(self) -> dict[str, tuple[int, int, float]]:
        """This worker's own counts (read by the sync thread; dict copies are atomic)."""
        inflight, prefill, last = dict(self._inflight), dict(self._prefill), dict(self._last_pick)
        return {b: (n, prefill.get(b, 0), last.get(b, -math.inf)) for b, n in inflight.items()}

    def set_remote(self, remote: dict[str, tuple[int, int, float]]) -> None:
        self._remote = remote

    # Hot path: plain dict reads (no super() calls); the parent's counters are ``_inflight``/``_prefill``.
    def inflight(self, backend: str) -> int:
        r = self._remote.get(backend)
        n = self._inflight.get(backend, 0)
        return n + r[0] if r else n

    def prefill_tokens(self, backend: str) -> int:
        r = self._remote.get(backend)
        n = self._prefill.get(backend, 0)
        return n + r[1] if r else n

    def total_inflight(self, backends: Iterable[str]) -> int:
        local, remote = self._inflight, self._remote
        total = 0
        for b in backends:
            total += local.get(b, 0)
            r = remote.get(b)
            if r:
                total += r[0]
        return total

    def last_pick(self, backend: str) -> float:
        r = self._remote.get(backend)
        return max(super().last_pick(backend), r[2] if r else -math.inf, self._seen_picks.get(backend, -math.inf))

    def view(self, backend: str, now: float) -> BackendLoad:
        local = super().view(backend, now)
        r = self._remote.get(backend)
        if r is None:
            return local
        inflight = local.inflight + r[0]
        prefill = local.prefill_tokens + r[1]
        # The local view already took the max with engine signals; adding the remote counts keeps that max.
        return BackendLoad(inflight, prefill, max(local.queue_tokens, float(prefill)), max(local.running, inflight),
                           local.kv_usage, max(local.last_pick, r[2], self._seen_picks.get(backend, -math.inf)))


class SharedHealth:
    """Mirrors breaker openings and probe-confirmed closings between workers (last writer wins)."""

    def __init__(self, shared: SharedState, board: HealthBoard) -> None:
        self._shared = shared
        self.board = board
        self._last: dict[str, float] = {}  # backend -> wall time of the newest event applied or sent
        self._mine: set[str] = set()  # backends whose newest opening was decided here
        board.add_listener(self._on_transition)

    def _event(self, t: Transition, at_wall: float) -> dict[str, Any]:
        until_wall = None
        if t.until is not None:
            until_wall = self._shared.wall() + (t.until - self._shared.clock())
        return {"b": t.backend, "s": t.new.value, "u": until_wall, "l": t.level, "r": t.reason, "t": at_wall,
                "w": self._shared.worker_id}

    def _on_transition(self, t: Transition) -> None:
        if t.origin != "local":
            return
        if t.new is BreakerState.OPEN or (t.new is BreakerState.CLOSED and t.reason == "probe_succeeded"):
            at = self._shared.wall()
            at = max(at, self._last.get(t.backend, 0.0) + 1e-6)
            self._last[t.backend] = at
            (self._mine.add if t.new is BreakerState.OPEN else self._mine.discard)(t.backend)
            self._shared._queue_health(self._event(t, at))

    def republish(self) -> list[dict[str, Any]]:
        """Current openings of this worker, for a Redis that came back (possibly empty)."""
        events = []
        now = self._shared.clock()
        for name in list(self._mine):
            br = self.board.breaker(name)
            if br.state is BreakerState.OPEN and br.until is not None and br.until > now:
                at = self._last.get(name, self._shared.wall())
                t = Transition(name, br.state, BreakerState.OPEN, br.reason, now, br.until, br.level)
                events.append(self._event(t, at))
        return events

    def apply(self, event: dict[str, Any]) -> bool:
        """Adopt another worker's transition if it is newer than what this worker knows."""
        if event.get("w") == self._shared.worker_id:
            return False
        backend, at = str(event["b"]), float(event["t"])
        if at <= self._last.get(backend, 0.0):
            return False
        self._last[backend] = at
        self._mine.discard(backend)
        now = self._shared.clock()
        br = self.board.breaker(backend)
        if event["s"] == BreakerState.OPEN.value and event.get("u") is not None:
            remaining = float(event["u"]) - self._shared.wall()
            if remaining <= 0:
                return False
            grace = 0.0 if event.get("r") == "capacity" else self._shared.config.follower_grace_s
            br.force_open(now, now + remaining + grace, level=int(event.get("l", 0)),
                          reason=str(event.get("r") or "remote"))
            return True
        if event["s"] == BreakerState.CLOSED.value:
            br.force_close(now, reason="remote_probe_succeeded")
            return True
        return False


class SharedState:
    """One worker's link to Redis; hands out shared indexes and load trackers per model group."""

    def __init__(
        self,
        url: str,
        config: SharedStateConfig | None = None,
        *,
        worker_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        client_factory: Callable[[str, SharedStateConfig], Any] | None = None,
        start: bool = True,
    ) -> None:
        self.url = url
        self.config = cfg = config or SharedStateConfig()
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self.clock = clock
        self.wall = wall
        self._client_factory = client_factory or _redis_client
        ns = cfg.namespace
        self._k_prefix, self._k_health, self._k_breakers = f"{ns}:prefix", f"{ns}:health", f"{ns}:breakers"
        self._k_workers, self._k_load, self._k_status = f"{ns}:workers", f"{ns}:load:", f"{ns}:status:"
        self._k_epoch, self._k_seeder = f"{ns}:epoch", f"{ns}:seeder"
        self._epoch: bytes | None = None
        self._lags: deque[float] = deque(maxlen=cfg.lag_samples)
        self.status_source: Callable[[], dict[str, Any]] | None = None  # this worker's counters for status
        self.peer_status: dict[str, dict[str, Any]] = {}  # the other live workers' counters, per heartbeat
        self.fingerprint: str | None = None  # of the hash secret (``hash_secret.fingerprint``), compared with peers
        self.secret_mismatch: list[str] = []  # live workers whose fingerprint differs from this one's
        self._publishers: dict[str, Callable[[], Any]] = {}
        self.on_heartbeat: Callable[[SharedState], None] | None = None  # e.g. metrics of lag and mismatches
        self._known_instances = 1
        self._lag_s: float | None = None  # age of the newest other worker's entry when applied (seconds)
        self._lag_max_s = 0.0
        self._clock_offset_s = 0.0  # Redis server time minus this host's wall clock
        self._indexes: dict[str, SharedPrefixIndex] = {}
        self._loads: dict[str, SharedLoadTracker] = {}
        self._pending: dict[str, deque[Sequence[Any]]] = {}
        self._health: SharedHealth | None = None
        self._outbox: deque[tuple[str, Any]] = deque(maxlen=cfg.max_outbox)
        self._health_out: deque[dict[str, Any]] = deque(maxlen=10_000)
        self._groups_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the request path: an index update waits for no poll tick
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._ids = {self._k_prefix: "$", self._k_health: "$"}
        self._bootstrapped = False
        self._health_bootstrap = False
        self._last_sync = -math.inf
        self._rng = random.Random()
        self.connected = False
        self.counters = {"sent": 0, "applied": 0, "dropped": 0, "connects": 0, "errors": 0, "health_applied": 0,
                         "entries": 0, "reseeds": 0}
        self.last_error = ""
        _INSTANCES.add(self)
        if start:
            self.start()

    def _after_fork(self) -> None:
        """In a forked worker (uvicorn/gunicorn ``--workers``): a new identity, fresh locks and thread."""
        running = self._thread is not None and not self._stop.is_set()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self._thread, self._client, self.connected = None, None, False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._groups_lock = threading.Lock()
        for idx in self._indexes.values():
            idx._lock = threading.Lock()
        if self._health is not None:
            for name in self._health.board.known():
                self._health.board.breaker(name)._lock = threading.RLock()
            self._health.board._lock = threading.RLock()
        self._outbox.clear()
        self._health_out.clear()
        self.peer_status = {}
        self.secret_mismatch = []
        self._last_sync = -math.inf
        if running:
            self.start()

    # --- what the plugin asks for ---------------------------------------------------------------
    def index(self, group: str, config: PrefixIndexConfig | None = None) -> SharedPrefixIndex:
        """The shared index of ``group`` (created on first call; replays updates that came earlier)."""
        with self._groups_lock:
            idx = self._indexes.get(group)
            if idx is None:
                idx = self._indexes[group] = SharedPrefixIndex(self, group, config)
                pending = self._pending.pop(group, None)
            else:
                pending = None
        if pending:
            now = self.clock()
            for op in pending:
                idx.apply(op, now)
        return idx

    def load(self, group: str, half_life_s: float = 2.0) -> SharedLoadTracker:
        with self._groups_lock:
            tracker = self._loads.get(group)
            if tracker is None:
                tracker = self._loads[group] = SharedLoadTracker(self, group, half_life_s)
            return tracker

    def health_board(self, config: BreakerConfig | None = None, board: HealthBoard | None = None) -> HealthBoard:
        """A ``HealthBoard`` whose openings and closings every worker sees (one per worker)."""
        if self._health is None:
            self._health = SharedHealth(self, board or HealthBoard(config))
            self._health_bootstrap = True  # the sync thread loads the breakers open right now
        return self._health.board

    def publish(self, name: str, source: Callable[[], Any]) -> None:
        """Send ``source()`` with every heartbeat; the other workers read it with ``peer_published(name)``."""
        self._publishers[name] = source

    def peer_published(self, name: str) -> list[Any]:
        """What the other live workers last published under ``name`` ([] once heartbeats are stale)."""
        if not self.remote_fresh():
            return []
        return [p["x"][name] for p in list(self.peer_status.values())
                if isinstance(p.get("x"), dict) and name in p["x"]]

    def known_instances(self) -> int:
        """Workers (this one included) seen live at the last heartbeat that reached Redis; kept while Redis is
        away, so a share of something split by it stays conservative."""
        return self._known_instances

    def new_client(self, *, guard: bool = False) -> Any:
        """A separate client to this Redis (``guard``: the short ``guard_timeout_s``)."""
        cfg = self.config
        if guard:
            cfg = dataclasses.replace(cfg, socket_timeout_s=cfg.guard_timeout_s)
        return self._client_factory(self.url, cfg)

    def remote_fresh(self) -> bool:
        """Other workers' load is trusted only while heartbeats succeed (within ``worker_ttl_s``)."""
        return self.clock() - self._last_sync <= self.config.worker_ttl_s

    def _expire_remote(self) -> None:
        if not self.remote_fresh():
            for tracker in list(self._loads.values()):
                if tracker._remote:
                    tracker.set_remote({})
                if tracker._remote_busy:
                    tracker.set_remote_busy({}, 0.0)

    def replication(self) -> dict[str, Any]:
        """This worker's replication lag in seconds, on the Redis server's clock (an entry's id → applied here):
        ``lag_s`` of the last other worker's update, ``lag_max_s`` the largest since the previous heartbeat, and
        ``lag_p50_s``/``lag_p90_s``/``lag_window_max_s`` over the last ``lag_samples`` entries (``samples``); a
        bootstrap's replayed history is not counted."""
        lags = sorted(self._lags)
        out: dict[str, Any] = {"lag_s": None if self._lag_s is None else round(self._lag_s, 4),
                               "lag_max_s": round(self._lag_max_s, 4), "connected": self.connected,
                               "outbox": len(self._outbox) + len(self._health_out), "samples": len(lags)}
        if lags:
            def pick(q: float) -> float:
                return round(lags[min(len(lags) - 1, int(q * len(lags)))], 4)
            out.update(lag_p50_s=pick(0.5), lag_p90_s=pick(0.9), lag_window_max_s=round(lags[-1], 4))
        else:
            out.update(lag_p50_s=None, lag_p90_s=None, lag_window_max_s=None)
        return out

    def stats(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "connected": self.connected,
                "outbox": len(self._outbox) + len(self._health_out),
                "groups": sorted(self._indexes), **self.counters, "last_error": self.last_error,
                "secret_mismatch": list(self.secret_mismatch), "instances": self._known_instances}

    # --- queueing (request path: append only) ---------------------------------------------------
    def _queue_index(self, group: str, op: tuple[Any, ...]) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self.counters["dropped"] += 1
        self._outbox.append(("i", (group, op)))
        self._wake.set()

    def _queue_health(self, event: dict[str, Any]) -> None:
        # A queue of its own: a long outage's index updates never push breaker events out.
        self._health_out.append(event)

    # --- the sync thread ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"kvroute-redis-{self.worker_id}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread after a last flush attempt; local state stays usable."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        self.connected = False

    def _run(self) -> None:
        delay = self.config.backoff_min_s
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                if self._client is None:
                    self._client = self._client_factory(self.url, self.config)
                    self._client.ping()
                    self._on_connect()
                    delay = self.config.backoff_min_s
                if self._health_bootstrap and self._health is not None:
                    self._load_breakers()
                self._flush()
                if self.clock() >= next_beat:
                    self._heartbeat()
                    next_beat = self.clock() + self.config.heartbeat_s
                self._expire_remote()
                more = self._read()
                if not more:
                    # Poll instead of XREAD BLOCK (one connection also writes); an update queued on the
                    # request path wakes the thread at once, so a pick reaches Redis without a poll tick.
                    self._wake.wait(self.config.flush_interval_s)
                    self._wake.clear()
            except Exception as exc:
                self._on_error(exc)
                wake = self.clock() + delay * (0.5 + self._rng.random())
                while not self._stop.is_set() and self.clock() < wake:  # forget others' load once it is stale
                    self._expire_remote()
                    self._stop.wait(min(0.1, max(0.0, wake - self.clock())))
                delay = min(self.config.backoff_max_s, delay * 2)
                next_beat = 0.0
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._flush()

    def _on_error(self, exc: BaseException) -> None:
        self.counters["errors"] += 1
        if self.connected:
            log.warning("kvroute: redis shared state lost (%s); routing on local state", exc)
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        self.connected = False
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _on_connect(self) -> None:
        c = self._client
        if self.counters["connects"] or self._bootstrapped:
            log.info("kvroute: redis shared state reconnected")
        self.counters["connects"] += 1
        if not self.counters.get("cluster_checked"):
            self.counters["cluster_checked"] = 1
            with contextlib.suppress(Exception):
                if int(c.info("cluster").get("cluster_enabled", 0)):
                    log.error("kvroute.redis_url: points at a Redis Cluster node; Cluster is not supported "
                              "(multi-key scripts and streams): use one primary")
        # Older kvroute stored the hash secret here, next to the keys it protects: never leave it readable.
        if c.delete(f"{self.config.namespace}:hash_secret"):
            log.warning("kvroute: deleted the hash secret an older kvroute stored in Redis "
                        "(%s:hash_secret); set hash_secret or hash_secret_file on every instance",
                        self.config.namespace)
        self._check_epoch()
        if not self._bootstrapped:
            # Late joiner: replay the newest updates and the breakers that are open right now.
            for stream in (self._k_prefix,):
                entries = c.xrevrange(stream, "+", "-", count=self.config.bootstrap_entries)
                for entry_id, fields in reversed(entries):
                    self._apply_entry(stream, fields)
                    self._ids[stream] = _id(entry_id)
                if not entries:
                    self._ids[stream] = "0-0"
            last = c.xrevrange(self._k_health, "+", "-", count=1)
            self._ids[self._k_health] = _id(last[0][0]) if last else "0-0"
            self._bootstrapped = True
        elif self._health is not None:
            for event in self._health.republish():
                self._queue_health(event)
        self.connected = True

    def _check_epoch(self) -> None:
        """Adopt the deployment's epoch; of the workers that find Redis emptied, the first re-seeds it
        (``<ns>:seeder``, SET NX: it vanishes with the next restart). A worker new to the deployment never does."""
        c = self._client
        c.set(self._k_epoch, os.urandom(8).hex().encode(), nx=True)
        stored = c.get(self._k_epoch)
        lost = self._epoch is not None and stored != self._epoch
        self._epoch = stored
        if lost:
            seeder = bool(c.set(self._k_seeder, self.worker_id, nx=True, ex=int(self.config.key_ttl_s)))
            if seeder:
                self._reseed()
            log.warning("kvroute: redis came back empty; %s", "re-seeding it from this worker's index" if seeder
                        else "another worker re-seeds it")

    def _reseed(self) -> None:
        """Queue this worker's index ahead of its pending updates (newest keys replayed last)."""
        cfg = self.config
        ops = [("i", (group, op)) for group, idx in list(self._indexes.items())
               for op in idx.snapshot_ops(cfg.reseed_blocks, cfg.reseed_chunk)]
        room = (self._outbox.maxlen or 0) - len(self._outbox)
        self._outbox.extendleft(reversed(ops[-room:] if room > 0 else []))
        self.counters["reseeds"] += 1

    def _load_breakers(self) -> None:
        """Adopt the latest transition of every backend (a worker that starts or attaches late)."""
        assert self._health is not None
        for raw in self._client.hgetall(self._k_breakers).values():
            try:
                if self._health.apply(_decode(raw)):
                    self.counters["health_applied"] += 1
            except Exception:
                self.counters["errors"] += 1
        self._health_bootstrap = False

    def _flush(self) -> None:
        cfg = self.config
        while self._outbox or self._health_out:
            health = [self._health_out.popleft() for _ in range(min(len(self._health_out), cfg.max_batch_ops))]
            index_ops = [self._outbox.popleft()[1] for _ in range(min(len(self._outbox), cfg.max_batch_ops))]
            try:
                pipe = self._client.pipeline(transaction=False)
                for event in health:
                    data = _encode(event)
                    pipe.xadd(self._k_health, {"w": self.worker_id, "d": data}, maxlen=10_000, approximate=True)
                    pipe.hset(self._k_breakers, event["b"], data)
                if index_ops:
                    # Keep ``stream_retention_s`` of history (catch-up and late joiners); the heartbeat
                    # also caps the entry count.
                    minid = f"{max(0, int((self.wall() - cfg.stream_retention_s) * 1000))}-0"
                    pipe.xadd(self._k_prefix, {"w": self.worker_id, "d": _encode(index_ops)}, minid=minid,
                              approximate=True)
                pipe.execute()
            except Exception:
                # Put the batch back (oldest first) so nothing is lost while Redis is away.
                self._health_out.extendleft(reversed(health))
                for op in reversed(index_ops):
                    if len(self._outbox) < (self._outbox.maxlen or 0):
                        self._outbox.appendleft(("i", op))
                    else:
                        self.counters["dropped"] += 1
                raise
            self.counters["sent"] += len(health) + len(index_ops)

    def _heartbeat(self) -> None:
        cfg = self.config
        wall, now = self.wall(), self.clock()
        mine = {}
        for group, tracker in list(self._loads.items()):
            counts = tracker.local_counts()
            busy = tracker.local_busy(now)
            # Last picks travel as wall-clock times so other workers can place them on their clocks; the fourth
            # field is this worker's busy seconds (a reader of three-field entries ignores it).
            mine[group] = {b: (n, p, wall - (now - t) if t > -math.inf else 0.0, busy.get(b, 0.0))
                           for b, (n, p, t) in counts.items()}
            for b, v in busy.items():
                if b not in mine[group]:
                    mine[group][b] = (0, 0, 0.0, v)
        ttl_ms = int(cfg.worker_ttl_s * 1000)
        key_ttl = int(cfg.key_ttl_s)
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._k_load + self.worker_id, _encode(mine), px=ttl_ms)
        pipe.set(self._k_status + self.worker_id, _encode(self._status_blob()), px=ttl_ms)
        pipe.zadd(self._k_workers, {self.worker_id: wall})
        pipe.zremrangebyscore(self._k_workers, "-inf", wall - cfg.worker_ttl_s)
        pipe.xtrim(self._k_prefix, maxlen=cfg.stream_maxlen, approximate=True)
        for key in (self._k_workers, self._k_prefix, self._k_health, self._k_breakers, self._k_epoch):
            pipe.expire(key, key_ttl)
        pipe.time()
        pipe.zrange(self._k_workers, 0, -1)
        *_, server_time, workers = pipe.execute()
        self._clock_offset_s = float(server_time[0]) + float(server_time[1]) / 1e6 - self.wall()
        others = [w.decode() if isinstance(w, bytes) else str(w) for w in workers]
        others = [w for w in others if w != self.worker_id]
        self._known_instances = 1 + len(others)
        blobs = self._client.mget([self._k_load + w for w in others]) if others else []
        statuses = self._client.mget([self._k_status + w for w in others]) if others else []
        self.peer_status = {w: _decode(b) for w, b in zip(others, statuses, strict=True) if b}
        self._check_fingerprints()
        if self.on_heartbeat is not None:
            with contextlib.suppress(Exception):
                self.on_heartbeat(self)
        sums: dict[str, dict[str, list[float]]] = {}
        for blob in blobs:
            if not blob:
                continue
            for group, per in _decode(blob).items():
                g = sums.setdefault(group, {})
                for backend, entry in per.items():
                    n, p, t_wall = entry[0], entry[1], entry[2]
                    acc = g.setdefault(backend, [0, 0, -math.inf, 0.0])
                    acc[0] += int(n)
                    acc[1] += int(p)
                    if t_wall:
                        acc[2] = max(acc[2], now - (wall - float(t_wall)))
                    if len(entry) > 3:
                        acc[3] += float(entry[3])
        for group, tracker in list(self._loads.items()):
            per = sums.get(group, {})
            tracker.set_remote({b: (int(v[0]), int(v[1]), v[2]) for b, v in per.items()})
            tracker.set_remote_busy({b: v[3] for b, v in per.items() if v[3] > 0}, now)
        self._last_sync = self.clock()

    def _status_blob(self) -> dict[str, Any]:
        """This worker's status for the others: its counters, replication, secret fingerprint, publications."""
        blob: dict[str, Any] = {}
        if self.status_source is not None:
            try:
                blob.update(self.status_source())
            except Exception as exc:  # the worker's own view must never stop the heartbeat
                log.debug("status source failed: %s", exc)
        published = {}
        for name, source in list(self._publishers.items()):
            try:
                published[name] = source()
            except Exception as exc:
                log.debug("publisher %s failed: %s", name, exc)
        blob.update({"x": published, "fp": self.fingerprint, "replication": self.replication()})
        self._lag_max_s = 0.0
        return blob

    def _check_fingerprints(self) -> None:
        """Say loudly (once per worker) when a live worker keys its hashes with another secret."""
        if self.fingerprint is None:
            return
        mismatch = sorted(w for w, p in self.peer_status.items() if p.get("fp") not in (None, self.fingerprint))
        for w in set(mismatch) - set(self.secret_mismatch):
            log.error("kvroute: worker %s uses a different hash_secret (fingerprint %s, ours %s): prefixes "
                      "routed by it never match here; give every instance the same hash_secret",
                      w, self.peer_status[w].get("fp"), self.fingerprint)
        self.secret_mismatch = mismatch

    def _read(self) -> bool:
        """Apply the other workers' new entries; True when a full page came (more may be waiting)."""
        count = 512
        result = self._client.xread(dict(self._ids), count=count)
        full = False
        for stream, entries in result or []:
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            for entry_id, fields in entries:
                self._apply_entry(name, fields, entry_id)
                self._ids[name] = _id(entry_id)
            full = full or len(entries) >= count
        return full

    def _apply_entry(self, stream: str, fields: dict[Any, Any], entry_id: Any = None) -> bool:
        """Apply another worker's entry (its lag recorded when ``entry_id`` is given); False for this worker's
        own and for a worker keyed with another secret."""
        worker = fields.get(b"w", fields.get("w"))
        if isinstance(worker, bytes):
            worker = worker.decode()
        if worker == self.worker_id:
            return False
        self.counters["entries"] += 1
        if entry_id is not None:
            lag = self.wall() + self._clock_offset_s - int(_id(entry_id).split("-", 1)[0]) / 1000.0
            self._lag_s = max(0.0, lag)
            self._lag_max_s = max(self._lag_max_s, self._lag_s)
            self._lags.append(self._lag_s)
        if worker in self.secret_mismatch and stream == self._k_prefix:
            self.counters["foreign"] = self.counters.get("foreign", 0) + 1  # keyed with another secret
            return False
        data = _decode(fields.get(b"d", fields.get("d")))
        if stream == self._k_health:
            if self._health is not None and self._health.apply(data):
                self.counters["health_applied"] += 1
            return True
        now = self.clock()
        for group, op in data:
            idx = self._indexes.get(group)
            if idx is None:
                with self._groups_lock:
                    idx = self._indexes.get(group)
                    if idx is None:
                        q = self._pending.setdefault(group, deque(maxlen=self.config.max_pending_per_group))
                        q.append(op)
                        continue
            idx.apply(op, now)
            if op[0] == "r":
                tracker = self._loads.get(group)
                if tracker is not None:
                    tracker.saw_remote_pick(str(op[1]), now)
            self.counters["applied"] += 1
            time.sleep(0)  # yield the GIL between ops: the request path comes first
        return True


_INSTANCES: weakref.WeakSet[SharedState] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for shared in list(_INSTANCES):
        with contextlib.suppress(Exception):
            shared._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


def _as_list(keys: Sequence[int]) -> list[int]:
    """Keys as a list without copying the usual case (the router never mutates a request's keys)."""
    return keys if isinstance(keys, list) else list(keys)


def _id(entry_id: Any) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _redis_client(url: str, config: SharedStateConfig) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=config.socket_timeout_s,
                                socket_connect_timeout=config.socket_timeout_s, health_check_interval=0)


def connect(url: str, config: SharedStateConfig | None = None, **kwargs: Any) -> SharedState:
    """Start sharing through the Redis at ``url``; never raises for an unreachable Redis (it retries)."""
    return SharedState(url, config, **kwargs)
