"""Server-owned request identity: the ledger request id, kvroute's attempt counter and the ticket id of each attempt.

Three ids, three things (none taken from what a client sends):

- **ledger request id** -- a random uuid4 hex kvroute assigns the first time it sees a request (its first pick, or its
  first outcome when no pick ran). Stored in the request metadata under ``kvroute_request`` with an HMAC tag
  (``kvroute_sig``, a per-process secret) so a client-sent value can never be mistaken for one kvroute wrote.
- **attempt** -- kvroute's own counter per ledger request, kept here (LiteLLM copies the metadata dict between
  fallback hops, so a counter in the dict would go stale); ``kvroute_attempt`` only mirrors it.
- **ticket id** -- ``<ledger request id>:<attempt>``, the routing policy's handle on one attempt (``kvroute_rid``).

LiteLLM's trace id, ``x-session-id`` and ``litellm_call_id`` (settable with the ``x-litellm-call-id`` header) are
client-controlled and are used for none of them. Client-sent ``kvroute_*`` identity keys of any type are dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

REQUEST_KEY = "kvroute_request"
SIG_KEY = "kvroute_sig"
TICKET_KEY = "kvroute_rid"
ATTEMPT_KEY = "kvroute_attempt"
SERVER_KEYS = (REQUEST_KEY, SIG_KEY, TICKET_KEY, ATTEMPT_KEY, "kvroute_trace")
MAX_REQUESTS = 100_000


@dataclass(slots=True)
class Attempt:
    """One upstream attempt (or router-level hop) of a request, as kvroute saw it."""

    number: int
    group: str
    backend: str | None  # None: LiteLLM had no deployment for the hop (nothing was called)
    sent: bool = False
    recorded: bool = False
    started_at: datetime | None = None
    model_info: dict[str, Any] | None = None
    served: str | None = None
    streamed: int = 0  # chunks with output relayed from this attempt (≈ output tokens; billing of a cut stream)


@dataclass(slots=True)
class RequestState:
    """What kvroute knows of one client request across its attempts."""

    request_id: str
    attempts: list[Attempt] = field(default_factory=list)
    outcome_recorded: bool = False
    success_recorded: bool = False
    app: str | None = None  # the billed app, fixed by the request's first ledger event

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


class RequestIds:
    """Issues and verifies ledger request ids and counts attempts (bounded: the oldest requests are forgotten)."""

    def __init__(self, max_requests: int = MAX_REQUESTS) -> None:
        self._key = secrets.token_bytes(32)
        self.max_requests = max_requests
        self.requests: OrderedDict[str, RequestState] = OrderedDict()

    def _sign(self, request_id: str) -> str:
        return hmac.new(self._key, request_id.encode(), hashlib.sha256).hexdigest()[:24]

    def request_of(self, meta: Any) -> str | None:
        """The ledger request id in ``meta`` if kvroute wrote it (valid tag), else None."""
        if not isinstance(meta, MutableMapping):
            return None
        rid, sig = meta.get(REQUEST_KEY), meta.get(SIG_KEY)
        if isinstance(rid, str) and isinstance(sig, str) and hmac.compare_digest(sig, self._sign(rid)):
            return rid
        return None

    def begin(self, meta: MutableMapping[str, Any]) -> RequestState:
        """The request's state; on first sight drop every client-sent kvroute identity key and issue a new id."""
        rid = self.request_of(meta)
        if rid is None:
            for key in SERVER_KEYS:
                meta.pop(key, None)
            rid = uuid.uuid4().hex
            meta[REQUEST_KEY] = rid
            meta[SIG_KEY] = self._sign(rid)
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = RequestState(rid)
            while len(self.requests) > self.max_requests:
                self.requests.popitem(last=False)
        return state

    def state(self, meta: Any) -> RequestState | None:
        rid = self.request_of(meta)
        return self.requests.get(rid) if rid else None

    def new_attempt(self, meta: MutableMapping[str, Any], group: str, backend: str | None) -> tuple[Attempt, str]:
        """Count the next attempt of the request in ``meta``; returns it and its ticket id (also written to meta)."""
        state = self.begin(meta)
        attempt = Attempt(len(state.attempts) + 1, group, backend)
        state.attempts.append(attempt)
        ticket_id = f"{state.request_id}:{attempt.number}"
        meta[TICKET_KEY] = ticket_id
        meta[ATTEMPT_KEY] = attempt.number
        return attempt, ticket_id

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
