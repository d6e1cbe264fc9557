"""Whom a failed attempt blames: an exception → ``Attribution`` (the backend or nobody, and what kind of failure).

One classifier read by the hook, the breaker and the ledger. A backend is blamed only when it was called and
failed for a reason of its own: a connect error, its 5xx, a timeout or slow first token, a stream it cut, its
429 (capacity) or its 401/402/403/404 (its configuration). Router-level errors (no deployments, cooldown,
budget, auth at the proxy), requests rejected before any upstream call (LiteLLM's own validation, surfaced as
``APIConnectionError`` over a ``TypeError``), 4xx caused by the request and client disconnects blame nobody.

Pure duck typing over the exception and its ``__cause__``/``__context__`` chain: class names, ``status_code``,
``response.status_code`` and ``headers``; no LiteLLM import.

| evidence in the chain (first that applies)                    | kind               | blames |
|---------------------------------------------------------------|--------------------|--------|
| ``CancelledError`` / client disconnect                        | cancelled          | no     |
| ``RouterRateLimitError``, budget, proxy-side errors (auth...) | router             | no     |
| an upstream HTTP answer (``HTTPStatusError``, openai status)  | by status          | 5xx/429/401-404/408 |
| "No deployments available", "Invalid model name" (text only)  | router             | no     |
| transport error (connect/read/timeout/protocol) from httpx... | connect/timeout/…  | yes    |
| a plain Python error at the root (TypeError, ValueError, ...) | request_rejected   | no     |
| otherwise: ``status_code`` and type words                     | by status/type     | as above |
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from kvroute.policies.health import Outcome


class FailureKind(StrEnum):
    """What went wrong with one attempt; the first eight blame the backend, the rest blame nobody."""

    CONNECT_ERROR = "connect_error"  # no connection could be made (refused, unreachable)
    CONNECTION_LOST = "connection_lost"  # an open connection was reset or closed before any answer came
    TIMEOUT = "timeout"
    SLOW_FIRST_TOKEN = "slow_first_token"
    STREAM_CUT = "stream_cut"
    BACKEND_ERROR = "backend_error"
    CAPACITY = "capacity"
    BACKEND_CONFIG = "backend_config"
    REQUEST_INVALID = "request_invalid"
    REQUEST_REJECTED = "request_rejected"
    ROUTER = "router"
    CANCELLED = "cancelled"


_P, _C = Outcome.PROVIDER_FAILURE, Outcome.CLIENT_ERROR
#: The one outcome vocabulary and its views: kind -> (blames the backend, the breaker's outcome, the ledger status).
#: The breaker's outcome applies when the backend is blamed; a verdict blaming nobody is ``client_error`` to the
#: breaker (``cancelled`` for a cancellation), which hands a half-open probe back without counting it.
KINDS: dict[FailureKind, tuple[bool, Outcome, str]] = {
    FailureKind.CONNECT_ERROR: (True, _P, "provider_failure"),
    FailureKind.CONNECTION_LOST: (True, _P, "provider_failure"),
    FailureKind.TIMEOUT: (True, _P, "provider_failure"),
    FailureKind.SLOW_FIRST_TOKEN: (True, _P, "provider_failure"),
    FailureKind.STREAM_CUT: (True, _P, "provider_failure"),
    FailureKind.BACKEND_ERROR: (True, _P, "provider_failure"),
    FailureKind.CAPACITY: (True, Outcome.CAPACITY, "capacity"),
    FailureKind.BACKEND_CONFIG: (True, Outcome.CONFIG_FAILURE, "provider_failure"),
    FailureKind.REQUEST_INVALID: (False, _C, "client_error"),
    FailureKind.REQUEST_REJECTED: (False, _C, "client_error"),
    FailureKind.ROUTER: (False, _C, "no_route"),
    FailureKind.CANCELLED: (False, Outcome.CANCELLED, "cancelled"),
}
BLAMING = frozenset(k for k, (blames, _, _) in KINDS.items() if blames)
LEDGER_STATUS = {k: status for k, (_, _, status) in KINDS.items()}


@dataclass(frozen=True, slots=True)
class Attribution:
    """The verdict on one failed attempt. ``outcome`` is what the breaker records (neutral when nobody is blamed);
    ``before_prefill`` is False only when the backend had started answering (a cut stream)."""

    kind: FailureKind
    blames_backend: bool
    status: int | None = None
    retry_after_s: float | None = None
    before_prefill: bool = True

    @property
    def outcome(self) -> Outcome:
        if self.blames_backend:
            return KINDS[self.kind][1]
        return Outcome.CANCELLED if self.kind is FailureKind.CANCELLED else Outcome.CLIENT_ERROR

    @property
    def ledger_status(self) -> str:
        """The ledger's status of the attempt (``no_route``, ``cancelled``, ``capacity``, ``client_error`` or
        ``provider_failure``)."""
        return LEDGER_STATUS[self.kind]

    def unsent(self) -> Attribution:
        """This verdict for an attempt known not to have reached a backend: it blames nobody (what ``classify``
        answers with ``backend_called=False``)."""
        if not self.blames_backend:
            return self
        return replace(self, blames_backend=False, retry_after_s=None, before_prefill=True)


def _norm(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


_CANCEL_WORDS = ("cancellederror", "clientdisconnect", "requestaborted", "clientdisconnected")
# Error-type words (LiteLLM/OpenAI exception names, OpenRouter ``error_type`` values), matched in a name lower-cased
# with everything but letters and digits dropped; the first rule that matches names the kind (None: the backend's
# own failure, whatever the default of the caller).
_TYPE_RULES: tuple[tuple[FailureKind | None, tuple[str, ...]], ...] = (
    (FailureKind.CANCELLED, ("cancel", "clientdisconnect", "aborted")),
    (None, ("midstream", "timeout", "timedout", "connect", "connection")),
    (FailureKind.CAPACITY, ("ratelimit", "overloaded", "capacity", "toomanyrequests", "quotaexceeded")),
    (FailureKind.BACKEND_CONFIG, ("authentication", "unauthorized", "permission", "forbidden", "notfound",
                                  "insufficientcredit", "paymentrequired", "invalidapikey")),
    (FailureKind.REQUEST_INVALID, ("contextwindow", "contextlength", "contentpolicy", "badrequest", "unprocessable",
                                   "invalidrequest", "validation", "toolarge")),
    (None, ("serviceunavailable", "internalserver", "badgateway", "server", "apierror", "unavailable")),
)


def typed_kind(error_type: str | type | None, *, mid_stream: bool = False) -> FailureKind | None:
    """The kind an error type's words name (an exception class or its name): cancelled, capacity, the backend's
    configuration or the request; None for the backend's own failure, for no word known, and for anything but a
    cancellation once the stream had started (``mid_stream``)."""
    if error_type is None:
        return None
    word = _norm(error_type if isinstance(error_type, str) else getattr(error_type, "__name__", str(error_type)))
    for kind, words in _TYPE_RULES:
        if any(w in word for w in words):
            return kind if kind is FailureKind.CANCELLED or not mid_stream else None
    return None
_ROUTER_WORDS = ("routerratelimiterror", "budgetexceeded", "proxyexception", "proxymodelnotfound",
                 "rejectedrequest", "nodeploymentsavailable", "invalidmodelname")
_ROUTER_TEXT = ("no deployments available", "all deployments for selected model are in cooldown",
                "budget exceeded", "exceeded budget", "invalid model name passed")
_TIMEOUT_WORDS = ("timeout", "timedout")
_CUT_WORDS = ("remoteprotocolerror", "incompleteread", "clientpayloaderror", "chunkedencodingerror", "midstream")
_CONNECT_WORDS = ("connecterror", "clientconnectorerror", "connectionrefused", "clientoserror", "networkerror",
                  "transporterror", "serverdisconnected", "protocolerror", "readerror", "writeerror",
                  "connectionreset", "brokenpipe")
# an open (pooled) connection the server reset or closed: the engine may be well (it closed an idle keep-alive
# connection as the request went out); a new connection that failed is ``_NEW_CONNECTION_WORDS``
_LOST_WORDS = ("connectionreset", "serverdisconnected", "brokenpipe")
_NEW_CONNECTION_WORDS = ("clientconnectorerror", "connecterror", "connectionrefused")
_WRAPPERS = ("apiconnectionerror", "apierror", "internalservererror", "serviceunavailableerror")  # LiteLLM/openai
_REJECT_MODULES = ("builtins", "json", "orjson", "pydantic", "pydantic_core", "jsonschema", "jinja2")
_REJECT_EXEMPT = ("oserror", "connection", "timeout", "brokenpipe", "cancelled", "eoferror")


def exception_links(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions that caused it (``__cause__``, else ``__context__``), outermost first, each once
    (12 at most)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen and len(seen) < 12:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _answered_status(link: BaseException) -> int | None:
    """The HTTP status of an upstream answer this link carries (httpx ``HTTPStatusError``, openai status errors)."""
    name = type(link).__name__
    module = type(link).__module__ or ""
    response = getattr(link, "response", None)
    if name == "HTTPStatusError" or (module.startswith("openai") and getattr(link, "status_code", None)):
        return _int(getattr(link, "status_code", None)) or _int(getattr(response, "status_code", None))
    return None


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds from a ``Retry-After`` header anywhere in the chain (None when absent or not a number)."""
    for link in exception_links(exc):
        for holder in (getattr(link, "response", None), link):
            headers = getattr(holder, "headers", None)
            if headers is None:
                continue
            try:
                value = headers.get("retry-after") or headers.get("Retry-After")
            except Exception:
                continue
            if value is None:
                continue
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                return None
            return max(0.0, seconds) if math.isfinite(seconds) else None
    return None


def _by_status(status: int, retry_after: float | None, mid_stream: bool) -> tuple[FailureKind, bool]:
    if status == 429 or (status == 503 and retry_after is not None):
        return FailureKind.CAPACITY, True
    if status in (401, 402, 403, 404):
        return FailureKind.BACKEND_CONFIG, True
    if status == 408:
        return FailureKind.TIMEOUT, True
    if status == 499:
        return FailureKind.CANCELLED, False
    if 400 <= status < 500:
        return FailureKind.REQUEST_INVALID, False
    if status >= 500:
        return (FailureKind.STREAM_CUT if mid_stream else FailureKind.BACKEND_ERROR), True
    return FailureKind.BACKEND_ERROR, True


def _connection_kind(names: list[str]) -> FailureKind:
    """``connection_lost`` when the chain's transport errors name an open connection reset or closed and none
    names a new connection that failed; else ``connect_error``."""
    lost = any(w in n for n in names for w in _LOST_WORDS)
    new = any(w in n for n in names for w in _NEW_CONNECTION_WORDS)
    return FailureKind.CONNECTION_LOST if lost and not new else FailureKind.CONNECT_ERROR


def classify_fields(http_status: int | None, error_class: str | None = None, message: str | None = None, *,
                    backend_called: bool | None = None) -> Attribution:
    """Attribute a failure known only by its logged fields (an HTTP status, an error class name, a message), by
    the same rules as ``classify``: a cancellation, the router's own refusal, the status, then the class name."""
    name, text = _norm(error_class or ""), (message or "").lower()[:300]
    retry_after = None

    def verdict(kind: FailureKind, blamed: bool) -> Attribution:
        return Attribution(kind, blamed and backend_called is not False, http_status)

    if any(w in name for w in _CANCEL_WORDS) or "client disconnected" in text:
        return verdict(FailureKind.CANCELLED, False)
    if any(w in name for w in _ROUTER_WORDS) or (not backend_called and any(t in text for t in _ROUTER_TEXT)):
        return verdict(FailureKind.ROUTER, False)
    if name not in _WRAPPERS and any(w in name for w in _TIMEOUT_WORDS):
        return verdict(FailureKind.TIMEOUT, True)
    if name not in _WRAPPERS and (any(w in name for w in _CONNECT_WORDS) or name == "connectionerror"):
        return verdict(_connection_kind([name]), True)
    typed = typed_kind(error_class) if error_class else None
    if http_status is not None:  # as ``classify`` reads an exception's ``status_code``
        kind, blamed = _by_status(http_status, retry_after, False)
        if kind in (FailureKind.BACKEND_ERROR, FailureKind.REQUEST_INVALID) and typed is FailureKind.CAPACITY:
            kind, blamed = FailureKind.CAPACITY, True
        return verdict(kind, blamed)
    kind = typed or FailureKind.BACKEND_ERROR
    return verdict(kind, kind in BLAMING)


def classify(exc: BaseException | None, *, backend_called: bool | None = None,
             first_token: bool = False) -> Attribution:
    """Attribute one failed attempt. ``backend_called=False`` (known not sent) never blames a backend;
    ``first_token``: the backend had already streamed a token (a timeout then is a cut, not a slow start)."""
    if exc is None:
        return Attribution(FailureKind.BACKEND_ERROR, backend_called is not False)
    links = list(exception_links(exc))
    names = [_norm(type(link).__name__) for link in links]
    text = " ".join(str(link)[:300].lower() for link in links)
    flat = _norm(text)
    status = _int(getattr(exc, "status_code", None))
    retry_after = retry_after_of(exc)
    mid_stream = first_token or "midstream" in flat or "incomplete chunked read" in text

    def verdict(kind: FailureKind, blamed: bool, code: int | None = status) -> Attribution:
        blamed = blamed and backend_called is not False
        cut = blamed and (mid_stream or kind is FailureKind.STREAM_CUT)
        return Attribution(kind, blamed, code, retry_after if blamed else None, before_prefill=not cut)

    if any(w in n for n in names for w in _CANCEL_WORDS) or "client disconnected" in text:
        return verdict(FailureKind.CANCELLED, False)
    if any(w in n for n in names for w in _ROUTER_WORDS):
        return verdict(FailureKind.ROUTER, False)
    for link in links:  # the backend answered: its status decides, whatever its message says
        answered = _answered_status(link)
        if answered is not None:
            kind, blamed = _by_status(answered, retry_after, mid_stream)
            return verdict(kind, blamed, answered)
    if any(t in text for t in _ROUTER_TEXT):
        return verdict(FailureKind.ROUTER, False)
    transport = [n for n in names if n not in _WRAPPERS]
    if any(w in n for n in transport for w in _TIMEOUT_WORDS):
        if mid_stream:
            return verdict(FailureKind.STREAM_CUT, True)
        slow = any("readtimeout" in n for n in transport)
        return verdict(FailureKind.SLOW_FIRST_TOKEN if slow else FailureKind.TIMEOUT, True)
    if any(w in n for n in transport for w in _CUT_WORDS):
        return verdict(FailureKind.STREAM_CUT, True)
    if any(w in n for n in transport for w in _CONNECT_WORDS) or "connectionerror" in transport:
        return verdict(FailureKind.STREAM_CUT if mid_stream else _connection_kind(transport), True)
    root = links[-1]
    root_module = (type(root).__module__ or "").split(".")[0]
    if len(links) > 1 and root_module in _REJECT_MODULES and not any(w in names[-1] for w in _REJECT_EXEMPT):
        return verdict(FailureKind.REQUEST_REJECTED, False)  # LiteLLM failed on the request before sending it
    if status is not None:
        if status == 400 and any("apiconnectionerror" in n for n in names):
            return verdict(FailureKind.REQUEST_REJECTED, False)  # LiteLLM's own input validation
        kind, blamed = _by_status(status, retry_after, mid_stream)
        if kind in (FailureKind.BACKEND_ERROR, FailureKind.REQUEST_INVALID) and \
                typed_kind(type(exc), mid_stream=mid_stream) is FailureKind.CAPACITY:
            kind, blamed = FailureKind.CAPACITY, True
        return verdict(kind, blamed)
    kind = typed_kind(type(exc), mid_stream=mid_stream) or (
        FailureKind.STREAM_CUT if mid_stream else FailureKind.BACKEND_ERROR)
    return verdict(kind, kind in BLAMING)
