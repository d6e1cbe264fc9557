"""An attempt's life as events: ``picked``, ``sent``, ``first_token``, ``answered`` and ``ended``.

The LiteLLM hooks only translate LiteLLM's payloads into these events; the ledger, the router's bookkeeping (which
tells the breaker) and the metrics are listeners, called in the order they subscribed (the ledger first: a kill
after the booking loses nothing). A listener's error is counted under its name and never reaches LiteLLM nor stops
the listeners after it. ``ended`` is emitted by whoever ends an attempt (its outcome, a newer attempt, a lost hedge,
the client leaving, the store's bound), and it carries the one verdict on a failure. The emitter marks the attempt
ended once every listener heard it; a later end of the same attempt (LiteLLM's success log of a stream whose client
left, a cut stream's failure after its success hook) still reaches the listeners, flagged ``late``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvroute.policies.outcomes import Attribution

#: ``(RequestState, Attempt)`` of ``kvroute.plugin.adapter.request_ids`` (which emits ``ended`` itself, so this
#: module does not import it)
Found = tuple[Any, Any]

class How(Enum):
    """How an attempt ended."""

    SUCCESS = "success"  # its answer is in (LiteLLM's success event)
    FAILED = "failed"  # its upstream call failed (the per-attempt failure hook, or the request-level one for it)
    CANCELLED = "cancelled"  # its client went away mid-stream
    SUPERSEDED = "superseded"  # a newer attempt of the request was picked before its outcome came
    HEDGE_LOST = "hedge_lost"  # it raced a hedge and lost: closed at once
    EVICTED = "evicted"  # the request store's bound forgot its request


@dataclass(slots=True, frozen=True)
class Payload:
    """What LiteLLM handed the hook that ended the attempt (the ledger reads its usage, prices and times)."""

    data: Mapping[str, Any]  # the call's kwargs / request data
    response: Any = None
    start: Any = None
    end: Any = None
    exception: BaseException | None = None
    relayed: int = 0  # output chunks the client got before it left
    usage: Any = None  # a provider's early usage (a stream's usage chunk)


@dataclass(slots=True, frozen=True)
class Answer:
    """A successful attempt's figures, read once from LiteLLM's payload."""

    group: str
    cached_tokens: int | None
    ttft_s: float | None
    prompt_tokens: int
    output_tokens: int | None
    duration_s: float | None
    ledger_tokens: Any


@dataclass(slots=True)
class Ended:
    """One attempt's end, as every listener sees it.

    ``found``: the request and attempt the hook resolved (None: not one kvroute issued); ``open``: that attempt
    when it was still awaiting its routed outcome (its router, policy and pick are on it), else None; ``backend``:
    the deployment the outcome names; ``verdict``: the failure's one classification, ``exception`` what it
    classified; ``answer``: a success's figures; ``payload``: LiteLLM's account of this attempt (None where the
    ending is kvroute's own, or LiteLLM's event was request-level and the ledger booked it as such);
    ``produced``: output a lost hedge had made; ``primary``: the lost hedge was the request's first route;
    ``request``: the request data of the newer attempt that superseded this one; ``late``: the attempt had ended
    before (set by ``AttemptEvents.ended``).
    """

    how: How
    found: Found | None
    open: Any  # the ``Attempt``, or None
    backend: str | None
    at: float
    verdict: Attribution | None = None
    exception: BaseException | None = None
    answer: Answer | None = None
    payload: Payload | None = None
    produced: int = 0
    primary: bool = False
    request: Mapping[str, Any] | None = None
    late: bool = False


class Listener(Protocol):
    """Something an attempt's events concern; it implements the events it needs (the others are not called)."""

    name: str


class AttemptEvents:
    """Subscribers per event, called in subscription order; a failing listener is counted by ``on_error``."""

    EVENTS = ("picked", "sent", "first_token", "answered", "ended")

    def __init__(self, on_error: Callable[[str], None]) -> None:
        self.on_error = on_error
        self._calls: dict[str, list[tuple[str, Callable[..., None]]]] = {e: [] for e in self.EVENTS}

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener``'s methods named after events from now on (after those subscribed before it)."""
        for event in self.EVENTS:
            method = getattr(listener, event, None)
            if callable(method):
                self._calls[event].append((listener.name, method))

    def listeners(self, event: str) -> list[str]:
        """The listeners of ``event``, in call order."""
        return [name for name, _ in self._calls[event]]

    def _emit(self, event: str, *args: Any) -> None:
        for name, call in self._calls[event]:
            try:
                call(*args)
            except Exception:
                self.on_error(name)

    def picked(self, attempt: Any, now: float) -> None:
        """kvroute pinned ``attempt`` to its backend."""
        self._emit("picked", attempt, now)

    def sent(self, found: Found, backend: str | None, data: Mapping[str, Any]) -> None:
        """The attempt goes upstream now, to ``backend`` (LiteLLM's pre-call; a retry may differ from the pick)."""
        self._emit("sent", found, backend, data)

    def first_token(self, attempt: Any) -> None:
        """The attempt's first streamed output: its prefill is over."""
        self._emit("first_token", attempt)

    def answered(self, attempt: Any) -> None:
        """The attempt's whole answer is back (its success event may come later)."""
        self._emit("answered", attempt)

    def ended(self, ending: Ended) -> None:
        """The attempt ended (``ending.how``): flagged ``late`` if it had before, marked ended after the listeners."""
        attempt = ending.found[1] if ending.found is not None else None
        if attempt is not None and attempt.ended:
            ending.late = True
        self._emit("ended", ending)
        if attempt is not None:
            attempt.ended = True
