"""Scorers of ``cache_aware``: each returns predicted seconds for one backend and knows nothing of the others.

Every scorer reads one ``Candidate`` (what the router knows about one backend for this request) and the
``EngineSpeed`` prior; the policy adds them up with weights and a picker chooses. Seconds from the prior
are multiplied by the backend's learned factor (observed / predicted time to first token).

| scorer | predicts | from |
|---|---|---|
| ``queue_wait`` | prefill work queued ahead on the backend | router's outstanding work now, engine queue depth |
| ``slot_wait`` | waiting for a free sequence slot | running requests over ``slots`` × learned decode time |
| ``own_prefill`` | this request's uncached prefill, decode steps sharing it | tier-credited match, running decoders |
| ``kv_pressure`` | waiting for running requests to end when its KV will not fit | KV usage (scraped), learned output |
| ``eviction`` | what the copy costs others: cache it evicts, recomputed later | index residency vs capacity |
| ``duplicate_work`` | recomputing a prefix held elsewhere, for the queue behind (none if idle) | extra × (1 + queue) |

Another scorer is a function of the same two arguments returning seconds, added with ``register_scorer`` and
weighted by name in a group's knobs (``scorers: {name: weight}``, which also reweighs the ones above).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.policies.load import BackendLoad
from kvroute.policies.speed import EngineSpeed


@dataclass(slots=True)
class Candidate:
    """One backend as the scorers see it for one request (tokens are prompt tokens)."""

    backend: str
    prompt: int
    matched: int
    view: BackendLoad
    factor: float
    work_s: float
    queued: int
    decode_s: float
    resident_tokens: float
    capacity_tokens: float
    best_matched: int = 0  # longest cached prefix any candidate holds (request-level)
    own_s: float = -1.0  # prefill_s(uncached, matched) when the caller computed it (else scorers do)
    best_own_s: float = 0.0  # the best holder's own prefill_s (request-level)
    output_tokens: float = 0.0  # learned mean output tokens of a request (fleet-wide; 0: unknown)
    #: the longest match is still being prefilled where it is held (request-level): a copy elsewhere would compute
    #: the same tokens at the same time
    reserved: bool = False
    #: tokens of other prompts this one would push out, where the index can tell (whole-prompt caches); -1:
    #: derive them from ``capacity_tokens`` and ``resident_tokens``
    evicts: float = -1.0
    uncached: int = field(init=False)

    def __post_init__(self) -> None:
        self.uncached = self.prompt - self.matched


Scorer = Callable[[Candidate, EngineSpeed], float]


def queue_wait(c: Candidate, speed: EngineSpeed) -> float:
    """Prefill queued ahead: the router's outstanding work at the pick (``LoadTracker.work_s``, drained in queue
    order), or the engine's reported queue if larger."""
    queued = c.work_s
    if c.view.queue_tokens > 0:
        queued = max(queued, c.view.queue_tokens / speed.prefill_tok_s)
    return c.factor * queued


def slot_wait(c: Candidate, speed: EngineSpeed) -> float:
    """Real seconds until a sequence slot frees when every slot is taken (learned decode duration)."""
    busy = max(c.view.inflight, c.view.running)
    if busy < speed.slots:
        return 0.0
    return (busy - speed.slots + 1) / speed.slots * c.decode_s


def own_prefill(c: Candidate, speed: EngineSpeed) -> float:
    """This request's uncached prefill, with the running decoders that share each of its steps."""
    own = c.own_s if c.own_s >= 0 else speed.prefill_s(c.uncached, c.matched)
    running = c.view.running
    if not running:
        return c.factor * own
    steps = math.ceil(max(1, c.uncached) / speed.chunk_tokens)
    return c.factor * (own + steps * running * speed.decode_s_per_seq)


def kv_pressure(c: Candidate, speed: EngineSpeed) -> float:
    """Real seconds of delay when the KV this request will hold does not fit what running requests leave free.

    It holds its uncached prompt and, by its end, a mean output (learned); the running requests grow by half a
    mean output each meanwhile (they are halfway through on average). What does not fit waits for, or is
    preempted until, the earliest running requests finish: they end staggered over a learned decode duration,
    one every ``decode_s / running`` seconds, each freeing ``used / running`` tokens, so the delay is that many
    completions' share of one decode duration (a whole one when nothing runs). Zero while it fits."""
    if c.capacity_tokens <= 0 or c.view.kv_usage <= 0:
        return 0.0
    used = c.view.kv_usage * c.capacity_tokens
    running = max(c.view.running, c.view.inflight)
    out = c.output_tokens
    short = c.uncached + out + running * out / 2.0 - (c.capacity_tokens - used)
    if short <= 0:
        return 0.0
    if running <= 0 or short >= used:  # nothing runs to make room, or more than every running request frees
        return c.decode_s
    return math.ceil(short * running / used) / running * c.decode_s  # short < used: at most all of them


def eviction(c: Candidate, speed: EngineSpeed) -> float:
    """Seconds others pay later for the cache this request's new blocks evict on a full backend (or, where the
    index tells, for the held prompts it pushes out: ``evicts``)."""
    if c.evicts >= 0:
        evicted = c.evicts
    elif c.capacity_tokens <= 0:
        return 0.0
    else:
        evicted = c.uncached - max(0.0, c.capacity_tokens - c.resident_tokens)
    if evicted <= 0:
        return 0.0
    return c.factor * speed.prefill_s(evicted)


def duplicate_work(c: Candidate, speed: EngineSpeed) -> float:
    """Prefill work this pick adds over the best holder's (recomputing a prefix the fleet already has),
    priced by who waits for it: on a busy backend once for the capacity it takes from the next arrival and
    once more per request queued there now; on an idle backend nobody (its capacity was unused, and this
    request's own longer prefill is ``own_prefill``'s) — unless the prefix is still being computed where it is
    held (``reserved``): then the copy is the same work done twice at once, and the next arrival pays for it."""
    if c.matched >= c.best_matched:
        return 0.0
    waiting = c.queued + (1 if c.view.inflight > 0 or c.queued > 0 or c.reserved else 0)
    if not waiting:
        return 0.0
    if c.own_s >= 0:
        extra = c.own_s - c.best_own_s
    else:
        extra = speed.prefill_s(c.uncached, c.matched) - speed.prefill_s(c.prompt - c.best_matched, c.best_matched)
    return c.factor * waiting * max(0.0, extra)


#: scorers that price what a pick does to other requests (the rest predict this request's TTFT)
FLEET_SCORERS: set[str] = {"evict", "others"}
#: scorers that read ``Candidate.resident_tokens`` (or ``evicts``); every other scorer must be a function of the
#: other inputs (tests/policies/test_scorer_properties.py checks it), so backends equal in those share its value
RESIDENT_SCORERS: set[str] = {"evict"}

#: scorer names as config knobs use them (``<name>_weight``, or ``scorers: {<name>: weight}``), in summing order
SCORERS: dict[str, Scorer] = {
    "queue": queue_wait,
    "slot": slot_wait,
    "prefill": own_prefill,
    "kv": kv_pressure,
    "evict": eviction,
    "others": duplicate_work,
}


def register_scorer(name: str, scorer: Scorer, *, fleet: bool = False, resident: bool = False) -> Scorer:
    """Add a scorer ``cache_aware`` can weigh by name (``knobs: {scorers: {<name>: <weight>}}``; off until
    weighted). ``fleet``: it prices what the pick costs others (summed after the TTFT scorers); ``resident``: it
    reads ``resident_tokens``/``evicts``. A name already taken raises ``ValueError``."""
    if not name.isidentifier() or name in SCORERS:
        raise ValueError(f"scorer name {name!r} is {'taken' if name in SCORERS else 'not an identifier'}")
    SCORERS[name] = scorer
    if fleet:
        FLEET_SCORERS.add(name)
    if resident:
        RESIDENT_SCORERS.add(name)
    return scorer
