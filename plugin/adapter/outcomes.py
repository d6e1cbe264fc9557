"""Outcomes of an attempt, fanned out once: the pick's load, the policy, the breaker and the metrics.

Each hook resolves its attempt record once (``RequestIds.resolve``) and a failure is classified once
(``kvroute.policies.outcomes.classify``); the verdict is kept on the record, and billing reads the same verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvroute.plugin.adapter.request_ids import TICKET_KEY, Attempt, RequestState
from kvroute.plugin.adapter.signals import (
    cached_tokens_of,
    completion_tokens_of,
    deployment_id,
    duration_s,
    ledger_tokens,
    prompt_tokens_of,
    ttft_of,
)
from kvroute.policies.lifecycle import CANCELLED, FAILURE, SUCCESS, RequestOutcome
from kvroute.policies.outcomes import Attribution, FailureKind, classify

if TYPE_CHECKING:
    from kvroute.plugin.adapter.callback_host import CallbackHost

Found = tuple[RequestState, Attempt] | None


def answered(cb: CallbackHost, found: Found) -> None:
    """The whole answer is back: release the pick's load now (the success event may come much later)."""
    ticket = cb.ids.open_attempt(found)
    if ticket is not None:
        ticket.router.on_answered(ticket.rid)


def first_token(cb: CallbackHost, meta: Any) -> None:
    """A streamed chunk arrived: on the attempt's first, prefill is over (later chunks return before any check:
    the attempt their metadata names has already seen its first token, so there is nothing to do)."""
    named = meta.get(TICKET_KEY) if isinstance(meta, dict) else None
    seen = cb.ids.open.get(named) if isinstance(named, str) else None
    if seen is not None and seen.first_token:
        return
    ticket = cb.ids.open_attempt(cb.ids.resolve(meta))
    if ticket is not None and not ticket.first_token:
        ticket.first_token = True
        ticket.router.on_first_token(ticket.rid)


def cancelled(cb: CallbackHost, found: Found) -> None:
    """The client went away: release load (what was prefilled may stay cached); neutral for health."""
    ticket = cb.ids.open_attempt(found)
    if ticket is None:
        return
    cb.ids.close(ticket.ticket)
    ticket.router.finish(ticket.request, RequestOutcome(CANCELLED, ticket.backend, cb.clock(), health="cancelled",
                                                        started_at=ticket.started), policy=ticket.policy)
    if ticket.backend is not None:
        cb.metrics.failed(ticket.backend, "cancelled", app=ticket.app)


def success(cb: CallbackHost, kwargs: Mapping[str, Any], response_obj: Any, start_time: Any, end_time: Any,
            found: Found) -> None:
    """A successful attempt: settle the pick with the cached tokens seen, teach the policy, record health."""
    ticket = cb.ids.open_attempt(found)
    if ticket is not None:
        cb.ids.close(ticket.ticket)
    slo = kwargs.get("standard_logging_object")
    slo = slo if isinstance(slo, Mapping) else {}
    backend_id = deployment_id(kwargs) or (ticket.backend if ticket else None)
    cached = cached_tokens_of(response_obj)
    ttft = ttft_of(kwargs, slo, start_time, end_time)
    group = str(slo.get("model_group") or (ticket.group if ticket else "") or "")
    prompt_tokens = prompt_tokens_of(response_obj, slo)
    now = cb.clock()
    if ticket is not None:
        # finish releases prefill and decode load and settles the blocks (no first-token step needed), then the
        # policy learns and the breaker hears the success
        ticket.router.finish(ticket.request, RequestOutcome(
            SUCCESS, backend_id, now, cached_tokens=cached, ttft_s=ttft,
            output_tokens=completion_tokens_of(response_obj), duration_s=duration_s(start_time, end_time),
            prompt_tokens=prompt_tokens or None, health="success", started_at=ticket.started), policy=ticket.policy)
    elif backend_id is not None:  # not routed by kvroute: the breaker still hears it
        cb.health.record(backend_id, "success", now, ttft_s=ttft)
    if backend_id is None:
        return
    app = ticket.app if ticket else cb.app_of(_metadata(kwargs), kwargs, found[0] if found else None)
    cb.metrics.completed(group, backend_id, app, prompt_tokens, cached, ttft, ledger_tokens(response_obj))
    if ticket is not None:
        cb.metrics.set_inflight([(backend_id, ticket.router.load.inflight(backend_id))])


def attempt_verdict(cb: CallbackHost, request_data: Mapping[str, Any], exception: BaseException,
                    found: Found) -> Attribution:
    """The verdict on the failed attempt ``found`` names (classified once; kept on its record)."""
    ticket = cb.ids.open_attempt(found)
    backend_called = deployment_id(request_data) is not None or bool(ticket and ticket.backend is not None)
    verdict = classify(exception, first_token=bool(ticket and ticket.first_token))
    verdict = verdict if backend_called else verdict.unsent()
    if found is not None:
        found[1].verdict = verdict
    return verdict


def attempt_failed(cb: CallbackHost, request_data: Mapping[str, Any], exception: BaseException,
                   found: Found, verdict: Attribution) -> Attribution:
    """One attempt failed: release its pick and feed the breaker what the verdict blames."""
    state = found[0] if found is not None else None
    if state is not None:
        state.note_judged(exception)
    ticket = cb.ids.open_attempt(found)
    if ticket is not None:
        cb.ids.close(ticket.ticket)
    backend_id = deployment_id(request_data) or (ticket.backend if ticket else None)
    if ticket is not None:
        kind = CANCELLED if verdict.kind is FailureKind.CANCELLED else FAILURE
        ticket.router.finish(ticket.request, RequestOutcome(
            kind, backend_id, cb.clock(), before_prefill=verdict.before_prefill,
            health=verdict.outcome.value if backend_id is not None else None,
            retry_after_s=verdict.retry_after_s, started_at=ticket.started), policy=ticket.policy)
    if backend_id is None:
        return verdict
    if ticket is not None and verdict.blames_backend and state is not None:
        state.note_failed(backend_id)
    if ticket is None:
        judge(cb, backend_id, verdict, None)
    else:  # finish told the breaker
        cb.metrics.failed(backend_id, verdict.outcome.value)
    return verdict


def request_verdict(cb: CallbackHost, kwargs: Mapping[str, Any], exception: BaseException,
                    found: Found) -> Attribution:
    """The verdict on a request-level failure event (classified once, for the breaker and the ledger alike)."""
    ticket = cb.ids.open_attempt(found)
    backend = deployment_id(kwargs)
    if ticket is not None and backend and ticket.backend != backend:
        return classify(exception)  # a newer attempt is in flight: the failed one was called
    verdict = classify(exception, first_token=bool(ticket and ticket.first_token))
    return verdict if ticket is not None and ticket.backend is not None else verdict.unsent()


def request_failed(cb: CallbackHost, kwargs: Mapping[str, Any], exception: BaseException, found: Found,
                   verdict: Attribution) -> Attribution | None:
    """LiteLLM's request-level failure event: judge it only when no per-attempt hook did (a bare SDK call,
    a cancellation). Its metadata may already name a newer attempt (a fallback's pick runs before this
    event), so only a verdict that blames a backend, or a cancellation, may touch that ticket."""
    state = found[0] if found is not None else None
    if state is not None and state.was_judged(exception):
        return None
    ticket = cb.ids.open_attempt(found)
    backend = deployment_id(kwargs)
    if ticket is not None and backend and ticket.backend != backend:
        # the metadata already names a newer attempt (a retry or a mid-stream continuation picked elsewhere):
        # judge the backend that failed, and leave the other attempt's ticket alone
        if verdict.blames_backend:
            state.note_judged(exception)  # type: ignore[union-attr]
            judge(cb, backend, verdict, None)
        return verdict
    if ticket is not None and (verdict.blames_backend or verdict.kind is FailureKind.CANCELLED):
        ticket.verdict = verdict
        return attempt_failed(cb, kwargs, exception, found, verdict)
    return verdict


def judge(cb: CallbackHost, backend_id: str, verdict: Attribution, started: float | None) -> None:
    """Give the breaker and the metrics one attempt's verdict (a neutral one hands a half-open probe back)."""
    outcome = verdict.outcome.value
    cb.health.record(backend_id, outcome, cb.clock(), retry_after_s=verdict.retry_after_s,
                     started_at=started)
    cb.metrics.failed(backend_id, outcome)


def _metadata(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    from kvroute.plugin.adapter.signals import request_metadata

    return request_metadata(kwargs) or {}
