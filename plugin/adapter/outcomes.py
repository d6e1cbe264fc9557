"""What an attempt's events mean for routing and for the metrics (two listeners of ``AttemptEvents``), and the
translations the hooks make first: LiteLLM's success payload into an ``Answer``, a failure into its one verdict
(``kvroute.policies.outcomes.classify``, kept on the attempt; the ledger, the breaker and the metric label read it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvroute.plugin.adapter.attempt_events import Answer, Ended, How
from kvroute.plugin.adapter.request_ids import Attempt, RequestIds, RequestState
from kvroute.plugin.adapter.signals import (
    cached_tokens_of,
    completion_tokens_of,
    deployment_id,
    duration_s,
    ledger_tokens,
    prompt_tokens_of,
    request_metadata,
    ttft_of,
)
from kvroute.policies.lifecycle import CANCELLED, FAILURE, SUCCESS, RequestOutcome
from kvroute.policies.outcomes import Attribution, FailureKind, classify

if TYPE_CHECKING:
    from kvroute.plugin.adapter.callback_host import CallbackHost

Found = tuple[RequestState, Attempt] | None
#: a success whose payload could not be read (the error is counted): it still ends, with nothing learned from it
UNREAD = Answer(group="", cached_tokens=None, ttft_s=None, prompt_tokens=0, output_tokens=None, duration_s=None,
                ledger_tokens=None)


def answer_of(kwargs: Mapping[str, Any], response: Any, start: Any, end: Any, attempt: Attempt | None) -> Answer:
    """The figures of LiteLLM's success event for ``attempt`` (None: not one kvroute issued)."""
    slo = kwargs.get("standard_logging_object")
    slo = slo if isinstance(slo, Mapping) else {}
    return Answer(group=str(slo.get("model_group") or (attempt.group if attempt else "") or ""),
                  cached_tokens=cached_tokens_of(response), ttft_s=ttft_of(kwargs, slo, start, end),
                  prompt_tokens=prompt_tokens_of(response, slo), output_tokens=completion_tokens_of(response),
                  duration_s=duration_s(start, end), ledger_tokens=ledger_tokens(response))


def attempt_verdict(request_data: Mapping[str, Any], exception: BaseException, found: Found) -> Attribution:
    """The verdict on the failed attempt ``found`` names (classified once; kept on its record)."""
    ticket = RequestIds.open_attempt(found)
    backend_called = deployment_id(request_data) is not None or bool(ticket and ticket.backend is not None)
    verdict = classify(exception, first_token=bool(ticket and ticket.first_token))
    verdict = verdict if backend_called else verdict.unsent()
    if found is not None:
        found[1].verdict = verdict
    return verdict


def request_verdict(kwargs: Mapping[str, Any], exception: BaseException, found: Found) -> Attribution:
    """The verdict on a request-level failure event, for the breaker and the ledger alike: the one an attempt's
    hook already reached for the same failure, else its classification."""
    known = found[0].verdict_of(exception) if found is not None else None
    if known is not None:
        return known
    ticket = RequestIds.open_attempt(found)
    backend = deployment_id(kwargs)
    if ticket is not None and backend and ticket.backend != backend:
        return classify(exception)  # a newer attempt is in flight: the failed one was called
    verdict = classify(exception, first_token=bool(ticket and ticket.first_token))
    return verdict if ticket is not None and ticket.backend is not None else verdict.unsent()


def final_verdict(state: RequestState | None, exception: BaseException) -> Attribution:
    """The verdict on the failure the client got: the one its attempt or request-level event already reached,
    else (a failure nothing judged: LiteLLM's refusal to route, a proxy check) its classification, kept."""
    known = state.verdict_of(exception) if state is not None else None
    if known is not None:
        return known
    verdict = classify(exception)
    if state is not None:
        state.note_judged(exception, verdict)
    return verdict


def request_failure_ending(kwargs: Mapping[str, Any], exception: BaseException, found: Found,
                           verdict: Attribution, now: float) -> Ended | None:
    """LiteLLM's request-level failure event as an attempt's end, where no per-attempt hook judged it (a bare SDK
    call, a cancellation); None when it ends nothing. Its metadata may already name a newer attempt (a fallback's
    pick runs before this event): then only a verdict that blames the backend that failed counts, and the newer
    attempt is left alone. The ledger booked the event at request level (no attempt payload)."""
    state = found[0] if found is not None else None
    if state is not None and state.verdict_of(exception) is not None:
        return None
    ticket = RequestIds.open_attempt(found)
    backend = deployment_id(kwargs)
    if ticket is not None and backend and ticket.backend != backend:
        if not verdict.blames_backend:
            return None
        failed = state.latest(backend=backend) if state is not None else None  # the older attempt that failed
        if failed is None and state is not None:
            state.note_judged(exception, verdict)  # no attempt of it named that backend: the request still knows
        return Ended(How.FAILED, (state, failed) if failed is not None else None, None, backend, now, verdict,
                     exception=exception)
    if ticket is not None and (verdict.blames_backend or verdict.kind is FailureKind.CANCELLED):
        ticket.verdict = verdict
        return Ended(How.FAILED, found, ticket, backend or ticket.backend, now, verdict, exception=exception)
    return None


class Routing:
    """The routing side of an attempt's events: the pick's load and index (``Router``), the policy's lesson and the
    breaker (``Router.finish`` tells it; an attempt kvroute did not route tells it directly)."""

    name = "routing"

    def __init__(self, cb: CallbackHost) -> None:
        self.cb = cb

    def sent(self, found: tuple[RequestState, Attempt], backend: str | None, data: Mapping[str, Any]) -> None:
        attempt = found[1]
        if attempt.awaiting and backend is not None:
            attempt.router.on_attempt(attempt.rid, backend)  # LiteLLM sent it elsewhere: the pick's load follows

    def first_token(self, attempt: Attempt) -> None:
        attempt.router.on_first_token(attempt.rid)

    def answered(self, attempt: Attempt) -> None:
        attempt.router.on_answered(attempt.rid)

    def picked(self, attempt: Attempt, now: float) -> None:
        self.cb.health.admit(attempt.backend, now)  # a half-open breaker lets this one through as its probe

    def ended(self, e: Ended) -> None:
        if e.how is How.SUCCESS:
            self._success(e)
        elif e.how is How.FAILED:
            self._failed(e)
        elif e.open is not None:  # cancelled, superseded, a lost hedge, evicted: the load goes, the breaker
            t = e.open  # hears only a client's leaving (neutral: a half-open probe goes back)
            health = "cancelled" if e.how is How.CANCELLED else None
            kind = FAILURE if e.how is How.SUPERSEDED else CANCELLED
            t.router.finish(t.request, RequestOutcome(kind, t.backend, e.at, health=health, started_at=t.started
                                                      if health else None), policy=t.policy)
        if e.how is How.HEDGE_LOST and e.found is not None:  # a hybrid group's spend cap counts what it cost
            loser = e.found[1]
            spend = getattr(loser.policy, "record_extra_spend", None)
            if callable(spend):
                spend(e.at, e.backend, loser.prompt_tokens, e.produced, f"{loser.ticket}:hedge_lost")

    def _success(self, e: Ended) -> None:
        a, t = e.answer or UNREAD, e.open
        if t is not None:
            # finish releases prefill and decode load and settles the blocks (no first-token step needed), then the
            # policy learns and the breaker hears the success
            t.router.finish(t.request, RequestOutcome(
                SUCCESS, e.backend, e.at, cached_tokens=a.cached_tokens, ttft_s=a.ttft_s,
                output_tokens=a.output_tokens, duration_s=a.duration_s, prompt_tokens=a.prompt_tokens or None,
                health="success", started_at=t.started), policy=t.policy)
        elif e.backend is not None:  # not routed by kvroute: the breaker still hears it
            self.cb.health.record(e.backend, "success", e.at, ttft_s=a.ttft_s)

    def _failed(self, e: Ended) -> None:
        verdict, state, t = e.verdict, e.found[0] if e.found is not None else None, e.open
        if verdict is None:
            return
        if state is not None and e.exception is not None:
            state.note_judged(e.exception, verdict)
        if t is not None:
            kind = CANCELLED if verdict.kind is FailureKind.CANCELLED else FAILURE
            t.router.finish(t.request, RequestOutcome(
                kind, e.backend, e.at, before_prefill=verdict.before_prefill,
                health=verdict.outcome.value if e.backend is not None else None,
                retry_after_s=verdict.retry_after_s, started_at=t.started), policy=t.policy)
            if e.backend is not None and verdict.blames_backend and state is not None:
                state.note_failed(e.backend, verdict.kind)  # a retry avoids it
        elif e.backend is not None:  # a backend kvroute did not route (or no longer awaits): the breaker hears it
            self.cb.health.record(e.backend, verdict.outcome.value, e.at, retry_after_s=verdict.retry_after_s)


class Counts:
    """The metrics of an attempt's end: completions with their tokens and TTFT, failures by the verdict's word.
    A success reported for an attempt that had already ended (LiteLLM's log of a stream after its client left, of a
    lost hedge) is no completion: that end was counted as what it was."""

    name = "metrics"

    def __init__(self, cb: CallbackHost) -> None:
        self.cb = cb

    def ended(self, e: Ended) -> None:
        metrics, t = self.cb.metrics, e.open
        if e.how is How.SUCCESS and e.late:
            return
        if e.how is How.SUCCESS and e.backend is not None and e.answer is not None:
            a = e.answer
            data = e.payload.data if e.payload is not None else {}
            app = t.app if t is not None else self.cb.app_of(request_metadata(data) or {}, data,
                                                              e.found[0] if e.found else None)
            metrics.completed(a.group, e.backend, app, a.prompt_tokens, a.cached_tokens, a.ttft_s, a.ledger_tokens)
            if t is not None:
                metrics.set_inflight([(e.backend, t.router.load.inflight(e.backend))])
        elif e.how is How.FAILED and e.backend is not None and e.verdict is not None:
            metrics.failed(e.backend, e.verdict.outcome.value)
        elif e.how is How.CANCELLED and t is not None and t.backend is not None:
            metrics.failed(t.backend, "cancelled", app=t.app)
        elif e.how is How.HEDGE_LOST and e.found is not None:
            metrics.hedges.labels(e.found[1].group, "lost").inc()
