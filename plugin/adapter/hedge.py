"""Hedged streams in the proxy: race a second hosted route when a stream's first token is late.

``hedged(...)`` wraps a proxy stream of a group with a ``hedge:`` block (``kvroute.policies.hedging``). It
passes chunks through until the first content chunk; if none came by the primary route's own delay and the
group's ``Hedger`` allows one, it sends the same request to the route ``Hedger.should_hedge`` picks (through
LiteLLM's router, pinned there, no retries or fallbacks: the same request id, a new attempt) and relays whichever
stream produces content first. The other is closed at once and booked by the ledger as a non-final
``cancelled`` attempt (``error_type: hedge_lost``). A stall before the provider's response headers is not seen
here: the hook runs once the stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.plugin.adapter.attempt_events import AttemptEvents, Ended, How, Payload
from kvroute.plugin.adapter.request_ids import ATTEMPT_KEY, HEDGE_TO_KEY, TICKET_KEY
from kvroute.plugin.adapter.signals import chunk_has_output, request_metadata
from kvroute.policies.hedging import HedgeConfig, Hedger, HedgeRoute

log = logging.getLogger("kvroute.plugin")

#: Request keys a hedge call does not copy: the proxy's own bookkeeping, LiteLLM's routing and the stream flag.
NOT_COPIED = frozenset({"model", "messages", "stream", "metadata", "litellm_metadata", "litellm_logging_obj",
                        "litellm_call_id", "proxy_server_request", "secret_fields", "user_api_key_dict",
                        "litellm_parent_otel_span", "headers", "num_retries", "fallbacks", "mock_response"})


async def close_stream(stream: Any) -> None:
    """Close a LiteLLM stream and the provider connection under it (never raises)."""
    with contextlib.suppress(BaseException):
        closer = getattr(stream, "aclose", None)
        if closer is not None:
            await closer()
        else:
            done = getattr(stream, "close", None)
            if done is not None:
                result = done()
                if asyncio.iscoroutine(result):
                    await result


@dataclass
class HedgeCall:
    """What one hedged stream needs from the plugin: the primary route, the routes to choose from, how to send
    the hedge, and what to do when a side wins or loses."""

    hedger: Hedger
    primary: HedgeRoute
    routes: list[HedgeRoute]
    prompt_tokens: int
    send: Callable[[str], Awaitable[Any]]  # backend -> the hedge's LiteLLM stream (pinned to it)
    lost: Callable[[str, int], None]  # (backend, content chunks it produced) -> book and release the loser
    won: Callable[[str, Any], None]  # (backend, stream) -> the winner is known
    clock: Callable[[], float] = time.monotonic
    sent_at: float = field(default_factory=time.monotonic)
    answered: Any = None  # the stream that answered (its hidden params name the deployment), once known


class _Side:
    """One racing stream: its pending next chunk and what it produced so far."""

    def __init__(self, backend: str, stream: Any) -> None:
        self.backend, self.stream = backend, stream
        self.iterator = stream.__aiter__()
        self.buffered: list[Any] = []
        self.content = 0
        self.task: asyncio.Task | None = None

    def next(self) -> asyncio.Task:
        if self.task is None:
            self.task = asyncio.ensure_future(self.iterator.__anext__())
        return self.task


async def hedged(primary: Any, call: HedgeCall) -> AsyncIterator[Any]:
    """Chunks of ``primary``, or of a hedge that produced content first (see the module docstring)."""
    hedger, first = call.hedger, _Side(call.primary.backend, primary)
    delay = hedger.delay(call.primary.backend, call.prompt_tokens, call.clock())
    deadline = None if delay is None else call.sent_at + delay
    sides, late = [first], False
    winner: _Side | None = None
    try:
        while winner is None:
            pending = {s.next(): s for s in sides}
            timeout = None
            if deadline is not None and not late:
                timeout = max(0.0, deadline - call.clock())
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the primary's first token is late
                late = True
                hedger.late(first.backend)
                target = hedger.should_hedge(call.primary, call.routes)
                if target is not None:
                    try:
                        sides.append(_Side(target.backend, await call.send(target.backend)))
                    except Exception as exc:  # the primary carries on alone
                        log.info("kvroute: a hedge to %s did not start: %s", target.backend, exc)
                continue
            side = pending[next(iter(done))]
            task, side.task = side.task, None
            try:
                chunk = task.result() if task is not None else None
            except StopAsyncIteration:
                if len(sides) == 1:
                    winner = side  # nothing to race: relay its end
                    break
                await _drop(side, sides, call)  # ended without content while the other may still answer
                continue
            except Exception:
                if len(sides) == 1:
                    raise
                await _drop(side, sides, call)
                continue
            side.buffered.append(chunk)
            if chunk_has_output(chunk):
                side.content += 1
                winner = side
        if late:
            hedger.settled(first.backend)
        for side in list(sides):
            if side is not winner:
                await _drop(side, sides, call)
        now = call.clock()
        if winner is first:
            hedger.learn(first.backend, call.prompt_tokens, now - call.sent_at, now)
        call.answered = winner.stream
        call.won(winner.backend, winner.stream)
        for chunk in winner.buffered:
            yield chunk
        async for chunk in winner.iterator:
            yield chunk
    finally:  # however it ended (the client may have left mid-race): nothing keeps reading, our streams closed
        for side in sides:
            if side.task is not None:
                side.task.cancel()
            if side is not first:  # the hedge's stream is ours; the proxy closes the primary's
                await close_stream(side.stream)


async def _drop(side: _Side, sides: list[_Side], call: HedgeCall) -> None:
    """Take ``side`` out of the race: stop reading it, close its provider stream, book it as lost."""
    sides.remove(side)
    if side.task is not None:
        side.task.cancel()
        side.task = None
    await close_stream(side.stream)
    call.lost(side.backend, side.content)


def routes_of(backends: Mapping[str, Any], group: str, *, open_breaker: Callable[[str], bool],
              full_cancel: Callable[[str], bool], expected_hit: Callable[[str], float]) -> list[HedgeRoute]:
    """The hedge candidates of ``group``: every deployment, hosted or not (``Hedger.choose`` filters); one group
    has one isolation, so a hedge never crosses it."""
    out = []
    for b in backends.values():
        if b.group != group:
            continue
        price = float(b.input_price) if b.input_price is not None else 0.0
        out.append(HedgeRoute(b.id, hosted=not b.self_hosted, model=b.model, breaker_closed=not open_breaker(b.id),
                              bills_loser_in_full=full_cancel(b.id), expected_hit=expected_hit(b.id), price=price))
    return out


class Hedges:
    """The groups' hedgers and how a proxy stream of one is raced (built once by the callback's set-up)."""

    def __init__(self, configs: Mapping[str, HedgeConfig], *, fleet: Any, ids: Any, available: Callable[[str], bool],
                 billing: Any, metrics: Any, events: AttemptEvents, expected_hit: Callable[[str], float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hedgers = {group: Hedger(cfg) for group, cfg in configs.items()}
        self.fleet, self.ids, self.available, self.billing, self.metrics = fleet, ids, available, billing, metrics
        self.events, self.expected_hit, self.clock = events, expected_hit, clock

    def call(self, request_data: dict) -> HedgeCall | None:
        """The race of a proxy stream whose group hedges and whose attempt went to a route (None: no race)."""
        group = str(request_data.get("model") or "")
        hedger = self.hedgers.get(group)
        meta = request_metadata(request_data)
        found = self.ids.resolve(meta) if hedger is not None and meta is not None else None
        if hedger is None or meta is None or found is None or not found[1].backend:
            return None
        state, attempt = found
        hedger.on_request()
        billing, metrics = self.billing, self.metrics
        routes = routes_of(self.fleet.backends, group, open_breaker=lambda b: not self.available(b),
                           full_cancel=lambda b: billing is not None and billing.cancel_billing_of(b) == "full",
                           expected_hit=self.expected_hit)
        primary = next((r for r in routes if r.backend == attempt.backend), None)
        if primary is None or not primary.hosted:
            return None

        async def send(backend: str) -> Any:
            from litellm.proxy import proxy_server

            hedge_meta = {k: v for k, v in meta.items() if k not in (TICKET_KEY, ATTEMPT_KEY)}
            hedge_meta[HEDGE_TO_KEY] = backend
            params = {k: v for k, v in request_data.items() if k not in NOT_COPIED and not k.startswith("litellm_")}
            metrics.hedges.labels(group, "sent").inc()
            return await proxy_server.llm_router.acompletion(
                model=group, messages=request_data.get("messages"), stream=True, metadata=hedge_meta,
                num_retries=0, disable_fallbacks=True, **params)

        def lost(backend: str, produced: int) -> None:
            loser = state.latest(backend=backend)
            if loser is None:
                return
            # booked (non-final), its pick's load released, its cost counted against a hybrid group's spend cap
            self.events.ended(Ended(How.HEDGE_LOST, (state, loser), self.ids.open_attempt((state, loser)), backend,
                                    self.clock(), payload=Payload(request_data), produced=produced,
                                    primary=backend == primary.backend))
            loser.hedge_lost = True

        def won(backend: str, stream: Any) -> None:
            if backend != primary.backend:
                metrics.hedges.labels(group, "won").inc()

        return HedgeCall(hedger, primary, routes, attempt.prompt_tokens, send, lost, won, clock=self.clock,
                         sent_at=attempt.started or self.clock())
