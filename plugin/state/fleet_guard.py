"""The hybrid guard's spend window, decision counts and overflow clock, shared by every instance through Redis.

``RedisSpend`` is the ``FleetSpend`` of one model group (``kvroute.policies.overflow_guard``):

- the spend window lives in four keys per group, ``<ns>:guard:{<group>}:held|paid|amt|tot`` (the braces keep
  them in one Cluster slot), changed only by one Lua script: expire what left the window, then hold, settle or
  release. A hold succeeds only if billed + held + the request's price stays within the budget, in the same
  atomic step, so no race between instances can overrun the window. Amounts are integers of 1e-9 currency
  units (rounded up), times are the Redis server's clock (instances' clocks do not matter); every key carries
  a TTL of the window plus the hold TTL;
- a reservation costs one Redis round trip on the hosted path only (self-hosted picks never wait on Redis);
  while the shared state's link is down or a call fails, ``reserve``/``spent`` answer None at once (the guard
  then spends only its local share), and settlements are kept (bounded) and replayed, with the time they were
  billed, once Redis answers again: the window reconciles. A settlement is idempotent (one entry per attempt),
  so after a reconnect each instance books again what it billed inside the window: an empty Redis that came
  back (restarted without persistence) holds the fleet's spend again within one heartbeat;
- the other instances' share-window counts and their last over-target time travel in the heartbeat the shared
  state already sends (``SharedState.publish``); the number of instances is the most recently seen.

``FleetTtft`` shares the hosted TTFT observations the same way: each instance publishes its newest own samples
per hosted backend (wall clock) and adds the ones it has not seen from the others to its own window.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from decimal import ROUND_CEILING, Decimal
from typing import Any

log = logging.getLogger("kvroute.fleet_guard")
UNIT = Decimal("1e-9")  # what one integer in Redis is worth, in the group's currency
RETRY_S = 1.0  # after a failed call, answer "away" for this long before trying again

_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, id = ARGV[1], ARGV[2]
local units, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local window, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local at = tonumber(ARGV[7])
if at == nil or at <= 0 or at > now then at = now end
local held, paid, amt, tot = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function add(field, v)
  if v ~= 0 then redis.call('HINCRBY', tot, field, string.format('%d', v)) end
end
local function drop(z, field, before)
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', '(' .. string.format('%d', before), 'LIMIT', 0, 1000)
  for _, m in ipairs(old) do
    local v = tonumber(redis.call('HGET', amt, m) or '0')
    redis.call('HDEL', amt, m)
    redis.call('ZREM', z, m)
    add(field, -v)
  end
end
local function unhold(m)
  local v = redis.call('HGET', amt, m)
  if v then
    redis.call('HDEL', amt, m)
    redis.call('ZREM', held, m)
    add('held', -tonumber(v))
  end
end
drop(paid, 'paid', now - window)
drop(held, 'held', now - ttl)
local ok = 1
local h = 'h:' .. id
if op == 'reserve' then
  unhold(h)
  local total = tonumber(redis.call('HGET', tot, 'held') or '0') + tonumber(redis.call('HGET', tot, 'paid') or '0')
  if budget >= 0 and total + units > budget then
    ok = 0
  else
    redis.call('ZADD', held, now, h)
    redis.call('HSET', amt, h, string.format('%d', units))
    add('held', units)
  end
elseif op == 'settle' then
  unhold(h)
  if units > 0 and at > now - window then
    local p = 'p:' .. id
    local prev = tonumber(redis.call('HGET', amt, p) or '0')
    redis.call('HSET', amt, p, string.format('%d', units))
    redis.call('ZADD', paid, at, p)
    add('paid', units - prev)
  end
elseif op == 'release' then
  unhold(h)
end
local keep = window + ttl + 60000
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], keep) end
return {ok, tonumber(redis.call('HGET', tot, 'paid') or '0'), tonumber(redis.call('HGET', tot, 'held') or '0')}
"""


def to_units(amount: Decimal) -> int:
    """``amount`` in integer 1e-9 units, rounded up (a hold never under-counts)."""
    return int((amount / UNIT).to_integral_value(rounding=ROUND_CEILING))


def from_units(units: int) -> Decimal:
    return Decimal(int(units)) * UNIT


class RedisSpend:
    """``FleetSpend`` of one group over the worker's ``SharedState`` (its config, worker id and heartbeat)."""

    def __init__(self, shared: Any, group: str, *, window_s: float, reservation_ttl_s: float = 120.0,
                 max_unsettled: int = 100_000, client: Any = None) -> None:
        self.shared = shared
        self.group = group
        ns = shared.config.namespace
        base = f"{ns}:guard:{{{group}}}"
        self.keys = [f"{base}:held", f"{base}:paid", f"{base}:amt", f"{base}:tot"]
        self.window_ms = int(window_s * 1000)
        self.ttl_ms = int(reservation_ttl_s * 1000)
        self._client = client
        self._script: Any = None
        self._lock = threading.Lock()
        self._away_until = 0.0
        # what this instance billed inside the window, (request id, units, wall ms): booked again after a reconnect
        self._book: deque[tuple[str, int, int]] = deque(maxlen=max_unsettled)
        self._dirty = False
        self._synced_connects = -1
        self._last: tuple[Decimal, Decimal] | None = None
        self.counters = {"reserved": 0, "refused": 0, "away": 0, "replayed": 0, "errors": 0}
        self.guard: Any = None  # the OverflowGuard whose local counts this instance publishes
        shared.publish(f"guard:{group}", self._publish)

    # --- FleetSpend ---------------------------------------------------------------------------------
    def reserve(self, request_id: str, amount: Decimal, budget: Decimal) -> bool | None:
        reply = self._call("reserve", request_id, to_units(amount), to_units(budget) if budget >= 0 else -1)
        if reply is None:
            self.counters["away"] += 1
            return None
        ok = bool(reply[0])
        self.counters["reserved" if ok else "refused"] += 1
        return ok

    def settle(self, request_id: str, amount: Decimal) -> None:
        units = max(0, to_units(amount))
        at = int(self.shared.wall() * 1000)
        if units > 0:
            with self._lock:
                self._book.append((request_id, units, at))
        if self._call("settle", request_id, units, -1, at) is None:
            self._dirty = True

    def release(self, request_id: str) -> None:
        self._call("release", request_id, 0, -1)

    def spent(self) -> tuple[Decimal, Decimal] | None:
        """The window as the last reply showed it (every call and heartbeat refreshes it; never waits)."""
        return self._last if self._usable() and self._last is not None else None

    def refresh(self) -> tuple[Decimal, Decimal] | None:
        """The window as Redis holds it now (one round trip)."""
        return None if self._call("peek", "", 0, -1) is None else self._last

    def instances(self) -> int:
        return max(1, int(self.shared.known_instances()))

    def peer_decisions(self) -> tuple[int, int]:
        hosted = total = 0
        for blob in self.shared.peer_published(f"guard:{self.group}"):
            with contextlib.suppress(Exception):
                hosted += int(blob.get("h", 0))
                total += int(blob.get("n", 0))
        return hosted, total

    def peer_over_ago(self) -> float | None:
        latest = 0.0
        for blob in self.shared.peer_published(f"guard:{self.group}"):
            with contextlib.suppress(Exception):
                latest = max(latest, float(blob.get("o") or 0.0))
        return max(0.0, self.shared.wall() - latest) if latest > 0 else None

    # --- the link -----------------------------------------------------------------------------------
    def _publish(self) -> dict[str, Any]:
        """This instance's share-window counts and last over-target time (wall clock), for the heartbeat; books
        its settlements again first when Redis came back (or a settlement did not reach it)."""
        connects = int(self.shared.counters.get("connects", 0))
        if self._book and (self._dirty or connects != self._synced_connects):
            if self.replay():
                self._synced_connects = connects
        elif not self._book:
            self._synced_connects = connects
        self.refresh()
        guard = self.guard
        if guard is None:
            return {}
        now = self.shared.clock()
        hosted, total = guard.local_counts(now)
        over = guard.last_over
        over_wall = self.shared.wall() - (now - over) if over > -float("inf") else 0.0
        return {"h": hosted, "n": total, "o": over_wall}

    def _usable(self) -> bool:
        return bool(self.shared.connected) and time.monotonic() >= self._away_until

    def _call(self, op: str, request_id: str, units: int, budget: int, at: int = 0) -> list[int] | None:
        """One script call; None (at once while the link is known to be down) when Redis does not answer."""
        if not self._usable():
            return None
        member = f"{self.shared.worker_id}:{request_id}" if request_id else ""
        try:
            script = self._ensure()
            reply = script(keys=self.keys, args=[op, member, units, budget, self.window_ms, self.ttl_ms, at])
        except Exception as exc:
            self.counters["errors"] += 1
            self._away_until = time.monotonic() + RETRY_S
            log.debug("kvroute: fleet guard %s: %s", self.group, exc)
            return None
        self._last = (from_units(reply[1]), from_units(reply[2]))
        return [int(x) for x in reply]

    def _ensure(self) -> Any:
        with self._lock:  # the request path and the heartbeat thread both call Redis
            if self._script is None:
                if self._client is None:
                    self._client = self.shared.new_client(guard=True)
                self._script = self._client.register_script(_SCRIPT)
            return self._script

    def replay(self) -> bool:
        """Book again, with the time each was billed, what this instance settled inside the window (idempotent:
        one entry per attempt); True when all of it reached Redis."""
        if not self._usable():
            return False
        horizon = int(self.shared.wall() * 1000) - self.window_ms
        with self._lock:
            while self._book and self._book[0][2] <= horizon:
                self._book.popleft()
            book = list(self._book)
        try:
            script = self._ensure()
            pipe = self._client.pipeline(transaction=False)
            for rid, units, at in book:
                script(keys=self.keys, args=["settle", f"{self.shared.worker_id}:{rid}", units, -1,
                                             self.window_ms, self.ttl_ms, at], client=pipe)
            pipe.execute()
        except Exception as exc:
            self.counters["errors"] += 1
            self._away_until = time.monotonic() + RETRY_S
            log.debug("kvroute: fleet guard %s replay: %s", self.group, exc)
            return False
        self._dirty = False
        self.counters["replayed"] += len(book)
        return True

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "booked": len(self._book), "connected": self._usable()}


class FleetTtft:
    """Hosted TTFT samples of one hybrid group, shared through the heartbeat (``max_samples`` newest per backend
    and instance)."""

    def __init__(self, shared: Any, group: str, policy: Any, max_samples: int = 32) -> None:
        self.shared = shared
        self.policy = policy
        self.name = f"ttft:{group}"
        self.max_samples = max_samples
        self._mine: dict[str, deque[tuple[float, float]]] = {}
        self._seen: dict[tuple[str, str], float] = {}  # (worker, backend) -> newest sample time applied
        self.merged = 0
        policy.ttft_listeners.append(self._observed)
        shared.publish(self.name, self._publish)

    def _observed(self, backend: str, ttft_s: float) -> None:
        q = self._mine.get(backend)
        if q is None:
            q = self._mine[backend] = deque(maxlen=self.max_samples)
        q.append((round(self.shared.wall(), 3), float(ttft_s)))

    def _publish(self) -> dict[str, list[tuple[float, float]]]:
        self.merge()
        return {b: list(q) for b, q in list(self._mine.items())}

    def merge(self) -> int:
        """Add the other instances' samples not seen yet; returns how many."""
        wall, now = self.shared.wall(), self.shared.clock()
        added = 0
        for worker, status in list(self.shared.peer_status.items()):
            per = (status.get("x") or {}).get(self.name) if isinstance(status, dict) else None
            if not isinstance(per, dict):
                continue
            for backend, samples in per.items():
                seen = self._seen.get((worker, backend), 0.0)
                newest = seen
                for at_wall, ttft in samples:
                    if at_wall > seen:
                        self.policy.observe_hosted_ttft(str(backend), float(ttft), now - max(0.0, wall - at_wall))
                        newest = max(newest, at_wall)
                        added += 1
                self._seen[(worker, backend)] = newest
        self.merged += added
        return added
