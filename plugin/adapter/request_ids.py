"""Server-owned request identity and the one record of each request and attempt (routing and billing read the same).

Three ids, three things (none taken from what a client sends):

- **ledger request id** -- 32 hex digits kvroute assigns the first time it sees a request (its first pick, or its
  first outcome when no pick ran): 16 digits drawn at random per process (again in a forked child) and a 16-digit
  counter, so issuing one makes no system call and no two processes share one. Stored in the request metadata
  under ``kvroute_request`` with an HMAC tag (``kvroute_sig``, a per-process secret) so a client-sent value can
  never be mistaken for one kvroute wrote.
- **attempt** -- kvroute's own counter per ledger request, kept here (LiteLLM copies the metadata dict between
  fallback hops, so a counter in the dict would go stale); ``kvroute_attempt`` only mirrors it.
- **ticket id** -- ``<ledger request id>:<attempt>``, the routing policy's handle on one attempt (``kvroute_rid``).

LiteLLM's trace id, ``x-session-id`` and ``litellm_call_id`` (settable with the ``x-litellm-call-id`` header) are
client-controlled and are used for none of them. Client-sent ``kvroute_*`` identity keys of any type are dropped.

``RequestIds`` is the only per-request store: a ``RequestState`` holds its ``Attempt`` records (what the pick chose,
what billing saw, the failure verdict), the backends that failed it and the exceptions already judged. A routed
attempt awaits its outcome while its router holds its policy-side record (``Attempt.awaiting``): the router's
``Attempts`` is the one index of open attempts, and its expiry is theirs. The request's app
(``kvroute.billing.attribution``, the one rule the ledger, metrics and routing rules share) is resolved once, when
kvroute first sees the request, and kept on its state. Evicting a request (the least recently changed beyond
``max_requests``) forgets all of it at once, and ends its open attempts (``evicted``, through ``events``). A
request is also forgotten once it has been quiet for ``quiet_s`` (no attempt running, none begun or closed since):
its attempts are over, and LiteLLM's late events for them (the success log runs after the response) have come. An
attempt runs while it awaits its routed outcome, or was sent upstream and neither booked nor judged (for ``stale_s``
at most). A hook resolves its attempt once (``resolve``: one HMAC check).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvroute.billing.attribution import AppRule
from kvroute.plugin.adapter.attempt_events import Ended, How
from kvroute.plugin.adapter.request_labels import LedgerLabels
from kvroute.plugin.adapter.signals import REQUEST_KEY
from kvroute.policies.attempts import RoutedAttempt
from kvroute.policies.outcomes import Attribution, FailureKind, exception_links

if TYPE_CHECKING:
    from kvroute.plugin.adapter.attempt_events import AttemptEvents
    from kvroute.policies.outcomes import Attribution
    from kvroute.policies.request import RoutingRequest

SIG_KEY = "kvroute_sig"
TICKET_KEY = "kvroute_rid"
ATTEMPT_KEY = "kvroute_attempt"
HEDGE_TO_KEY = "kvroute_hedge_to"  # the route a hedge call is pinned to (``plugin.adapter.hedge``)
SERVER_KEYS = (REQUEST_KEY, SIG_KEY, TICKET_KEY, ATTEMPT_KEY, "kvroute_trace", HEDGE_TO_KEY)
SUCCESS, FAILED, CANCELLED = "success", "failed", "cancelled"  # a request's final row (``RequestState.final``)
MAX_REQUESTS = 100_000
MAX_FAILED = 16  # backends remembered as failed per request (a retry avoids them)
MAX_JUDGED = 8  # failures remembered with their verdict per request
QUIET_S = 60.0  # a request with no attempt running and no change for this long is forgotten
STALE_S = 600.0  # ... and one with an attempt sent but never settled, after this long (its outcome never came)


@dataclass(slots=True)
class Attempt:
    """One upstream attempt (or router-level hop) of a request: the pick (``router`` set while kvroute routed it),
    what billing recorded, and the verdict on its failure (classified once)."""

    number: int
    group: str
    backend: str | None  # None: LiteLLM had no deployment for the hop (nothing was called)
    ticket: str = ""  # ``<ledger request id>:<number>``: the routing policy's handle (``rid``)
    sent: bool = False
    recorded: bool = False
    model_info: dict[str, Any] | None = None
    served: str | None = None
    streamed: int = 0  # chunks with output relayed from this attempt (≈ output tokens; billing of a cut stream)
    router: Any = None  # the group's ``Router`` when kvroute pinned this attempt (None: not routed)
    app: str | None = None
    prompt_tokens: int = 0
    cache_key: str | None = None
    #: ``RequestIds.clock`` reading of the pick, then of the upstream call (the ledger's start time is its wall view,
    #: ``RequestIds.wall``)
    started: float = 0.0
    first_token: bool = False
    #: the policy side's record of this attempt (its request, load charge and what the index predicted; held by
    #: its router until the outcome), or None when kvroute did not route it
    routed: RoutedAttempt | None = None
    policy: Any = None  # the policy that picked it
    salt: str | None = None
    verdict: Attribution | None = None  # the failure's attribution, once classified
    hedge_lost: bool = False  # it raced a hedge and lost: closed, booked ``cancelled`` (``hedge_lost``)
    ended: bool = False  # its first ``ended`` event reached every listener (``AttemptEvents.ended`` sets it)

    @property
    def rid(self) -> str:
        """The ticket id (the routing policy's name for this attempt)."""
        return self.ticket

    @property
    def request(self) -> RoutingRequest | None:
        """The routed ``RoutingRequest`` (kept on the policy side's record)."""
        return self.routed.request if self.routed is not None else None

    @property
    def awaiting(self) -> bool:
        """Whether kvroute routed it and its router still awaits its outcome (holds its record)."""
        routed = self.routed
        return routed is not None and self.router is not None and self.router.attempts.get(self.ticket) is routed


@dataclass(slots=True)
class RequestState:
    """What kvroute knows of one client request across its attempts."""

    request_id: str
    sig: str = ""  # the id's verified tag (a later check compares it instead of recomputing the HMAC)
    attempts: list[Attempt] = field(default_factory=list)
    #: the request's final ledger row: ``success``, ``failed`` or ``cancelled`` (None: none yet); see ``book_final``
    final: str | None = None
    app: str | None = None  # the request's app, resolved once (None: nothing names one; booked ``unattributed``)
    session_id: str | None = None  # the session the client names (header or metadata), for its ledger events
    tags: tuple[str, ...] = ()  # the request's metadata tags, for its ledger events
    booked: bool = False  # a ledger event of the request was built
    failed: list[str] = field(default_factory=list)  # backends blamed for this request's failed attempts
    lost: list[str] = field(default_factory=list)  # backends that lost an open connection of this request
    #: the verdict each failure of this request got (an exception is classified once; later events read it)
    judged: list[tuple[BaseException, Attribution]] = field(default_factory=list)
    changed: float = 0.0  # when an attempt of it last began or closed (``RequestIds.requests`` is in this order)

    def book_final(self, kind: str) -> None:
        """Note the request's final row: a client that left (``cancelled``) stays the request's end; an answer
        (``success``) replaces a failure booked before it, never the reverse."""
        if self.final == CANCELLED or (kind == FAILED and self.final == SUCCESS):
            return
        self.final = kind

    def note_failed(self, backend: str, kind: FailureKind | None = None) -> None:
        """Remember ``backend`` failed this request: a retry avoids it while others remain. A first lost
        connection (``connection_lost``) does not count: the engine may only have closed an idle connection as
        the request went out, and it holds the request's prefix; a second one does."""
        if kind is FailureKind.CONNECTION_LOST and backend not in self.lost:
            self.lost.append(backend)
            del self.lost[:-MAX_FAILED]
            return
        self.failed.append(backend)
        del self.failed[:-MAX_FAILED]

    def note_judged(self, exception: BaseException, verdict: Attribution) -> None:
        """Remember the verdict ``exception`` got (its consequences applied): later events of the same failure
        read it instead of classifying again, and do not apply it twice."""
        if any(j is exception for j, _ in self.judged):
            return
        self.judged.append((exception, verdict))
        del self.judged[:-MAX_JUDGED]

    def verdict_of(self, exception: BaseException) -> Attribution | None:
        """The verdict ``exception`` or one it wraps (``exception_links``: its causes, 12 at most) got, if judged."""
        if not self.judged:
            return None
        for link in exception_links(exception):
            for judged, verdict in self.judged:
                if judged is link:
                    return verdict
        return None

    def latest(self, backend: str | None = None, group: str | None = None, unrecorded: bool = False,
               hop: bool = False) -> Attempt | None:
        """The newest attempt matching every filter given (``hop``: a router-level hop, no backend)."""
        for a in reversed(self.attempts):
            if hop and a.backend is not None:
                continue
            if (backend is None or a.backend == backend) and (group is None or a.group == group) and \
                    not (unrecorded and a.recorded):
                return a
        return None


class _IdSource:
    """Unique 32-hex-digit ids without a system call: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)  # a forked worker must not repeat its parent's ids

    def reset(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


_IDS = _IdSource()


class RequestIds:
    """Issues and verifies ledger request ids and counts attempts (bounded: the oldest requests are forgotten); a
    listener of the attempts' ends (an end is a change of its request)."""

    name = "requests"

    def __init__(self, max_requests: int = MAX_REQUESTS,
                 app_rule: Callable[[Mapping[str, Any]], str | None] | None = None,
                 labels: Callable[[Mapping[str, Any]], tuple[str | None, tuple[str, ...]]] | None = None,
                 quiet_s: float = QUIET_S, stale_s: float = STALE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._key = secrets.token_bytes(32)
        self.max_requests = max_requests
        #: metadata -> the request's app (``billing.attribution.AppRule``: the plugin sets its claim keys and whether
        #: callers are the operator's code); by default a client's claim counts only where its key trusts it
        self.app_rule: Callable[[Mapping[str, Any]], str | None] = app_rule or AppRule()
        #: metadata -> (session id, tags) the request's ledger events carry (the plugin sets its tag keys)
        self.labels: Callable[[Mapping[str, Any]], tuple[str | None, tuple[str, ...]]] = labels or LedgerLabels()
        self.requests: OrderedDict[str, RequestState] = OrderedDict()
        self.quiet_s, self.stale_s = quiet_s, stale_s
        self.clock = clock
        self._epoch = time.time() - clock()  # wall seconds at clock reading 0 (``wall``; renewed by ``release_quiet``)
        #: where an evicted request's open attempts end (the callback's ``AttemptEvents``; None: nowhere)
        self.events: AttemptEvents | None = None

    def wall(self, reading: float) -> datetime:
        """The UTC wall time of a ``clock`` reading (an attempt's ``started``, as the ledger books it): one offset
        between releases, so a reading books as one time however often it is read."""
        return datetime.fromtimestamp(self._epoch + reading, UTC)

    def _sign(self, request_id: str) -> str:
        return hmac.new(self._key, request_id.encode(), hashlib.sha256).hexdigest()[:24]

    def request_of(self, meta: Any) -> str | None:
        """The ledger request id in ``meta`` if kvroute wrote it (valid tag), else None."""
        if not isinstance(meta, dict):  # request_metadata hands out dicts only
            return None
        rid, sig = meta.get(REQUEST_KEY), meta.get(SIG_KEY)
        if not isinstance(rid, str) or not isinstance(sig, str):
            return None
        state = self.requests.get(rid)
        expected = state.sig if state is not None and state.sig else self._sign(rid)
        return rid if hmac.compare_digest(sig, expected) else None

    def begin(self, meta: MutableMapping[str, Any]) -> RequestState:
        """The request's state; on first sight drop every client-sent kvroute identity key, issue a new id and
        resolve the request's app."""
        rid = self.request_of(meta)
        if rid is None:
            for key in SERVER_KEYS:
                meta.pop(key, None)
            rid = _IDS.next()
            meta[REQUEST_KEY] = rid
            meta[SIG_KEY] = self._sign(rid)
        state = self.requests.get(rid)
        if state is None:
            session_id, tags = self.labels(meta)
            state = self.requests[rid] = RequestState(rid, meta[SIG_KEY], app=self.app_rule(meta),
                                                      session_id=session_id, tags=tags)
            state.changed = self.clock()
            while len(self.requests) > self.max_requests:
                _, old = self.requests.popitem(last=False)
                for attempt in old.attempts:
                    if attempt.awaiting and self.events is not None:
                        self.events.ended(Ended(How.EVICTED, (old, attempt), attempt, attempt.backend, self.clock()))
        return state

    def state(self, meta: Any) -> RequestState | None:
        rid = self.request_of(meta)
        return self.requests.get(rid) if rid else None

    def new_attempt(self, meta: MutableMapping[str, Any], group: str,
                    backend: str | None) -> tuple[RequestState, Attempt]:
        """Count the next attempt of the request in ``meta``; returns the request and the attempt (whose ticket id,
        ``attempt.ticket``, is also written to meta)."""
        state = self.begin(meta)
        number = len(state.attempts) + 1
        ticket_id = f"{state.request_id}:{number}"
        attempt = Attempt(number, group, backend, ticket_id)
        state.attempts.append(attempt)
        self._touch(state.request_id)
        meta[TICKET_KEY] = ticket_id
        meta[ATTEMPT_KEY] = attempt.number
        return state, attempt

    def ticket_of(self, meta: Any) -> str | None:
        """The current attempt's ticket id in ``meta``, only if it belongs to kvroute's request id there."""
        rid = self.request_of(meta)
        tid = meta.get(TICKET_KEY) if rid else None
        if isinstance(tid, str) and tid.startswith(rid + ":"):  # type: ignore[operator]
            return tid
        return None

    def attempt_of(self, ticket_id: str | None) -> tuple[RequestState, Attempt] | None:
        """The request state and attempt a ticket id names (None once forgotten or when malformed)."""
        if not ticket_id:
            return None
        rid, _, number = ticket_id.rpartition(":")
        state = self.requests.get(rid)
        if state is None or not number.isdigit() or not 0 < int(number) <= len(state.attempts):
            return None
        return state, state.attempts[int(number) - 1]

    def resolve(self, meta: Any) -> tuple[RequestState, Attempt] | None:
        """The request and current attempt ``meta`` names, verified once (None when kvroute did not write it)."""
        return self.attempt_of(self.ticket_of(meta))

    @staticmethod
    def open_attempt(found: tuple[RequestState, Attempt] | None) -> Attempt | None:
        """The attempt of ``found`` if it still awaits its routed outcome."""
        return found[1] if found is not None and found[1].awaiting else None

    def ended(self, e: Ended) -> None:
        """An attempt of a request ended: the request changed (it is the newest, and quiet from now)."""
        if e.found is not None:
            self._touch(e.found[0].request_id)

    def open_attempts(self) -> list[Attempt]:
        """Every routed attempt still awaiting its outcome."""
        return [a for state in list(self.requests.values()) for a in state.attempts if a.awaiting]

    def _touch(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is not None:
            state.changed = self.clock()
            self.requests.move_to_end(request_id)

    def _running(self, state: RequestState, now: float) -> bool:
        """Whether an attempt of ``state`` still runs: routed and awaiting its outcome, or sent and not yet booked
        nor judged (until ``stale_s`` after the request last changed)."""
        for a in state.attempts:
            if a.awaiting:
                return True
            unsettled = a.sent and not a.recorded and a.verdict is None and not a.hedge_lost
            if unsettled and now - state.changed < self.stale_s:
                return True
        return False

    def release_quiet(self) -> int:
        """Forget the requests quiet for ``quiet_s`` (no attempt running, no change); how many were forgotten.
        Also re-reads the wall clock's offset (``wall``): a clock stepped, or a host suspended (a monotonic clock
        does not count the time asleep), is caught up at the next release."""
        now, quiet = self.clock(), []
        self._epoch = time.time() - now
        for rid, state in self.requests.items():  # least recently changed first
            if state.changed > now - self.quiet_s:
                break
            if not self._running(state, now):  # else a long stream: looked at next time
                quiet.append(rid)
        for rid in quiet:
            del self.requests[rid]
        return len(quiet)
