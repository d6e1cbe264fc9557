"""Billing on the request path: one ledger event per attempt, each outcome recorded exactly once.

Which hook records what (LiteLLM 1.110.2, verified through the proxy):

=================================================  ==========================================================
hook                                               ledger event
=================================================  ==========================================================
``async_post_call_success_hook`` (proxy, awaited   the final success, *before* the client gets its response,
before the response; streams: end of the stream)   so a kill right after the answer cannot lose it
``async_log_success_event`` (after the response)   the same event again (same id: a no-op) -- the SDK's record
``async_post_call_failure_deployment_hook``        each failed upstream attempt (non-final), inline, before
                                                   LiteLLM retries or falls back
``async_log_failure_event``                        a router-level hop (no deployment, cooldown) as ``no_route``
                                                   on backend ``router``; an attempt no earlier hook recorded
``async_post_call_failure_hook`` (proxy)           the request's final outcome when it failed (``outcome`` row)
the stream wrapper's close (the client left), or   the attempt serving the request, final, ``cancelled``, with
any hook's ``cancelled`` verdict (LiteLLM's 499)   what its provider bills for a cancel (``cancelled``)
=================================================  ==========================================================

Each event is built from ``CallFacts`` (``kvroute.billing.call_facts``): read from LiteLLM's payload where a hook has
one, else stated from kvroute's own attempt record (a pre-response success, a router-level hop, a superseded
attempt, a request's final outcome). The app is the request's, resolved once (``RequestState.app``).
Identity comes from ``kvroute.plugin.adapter.request_ids`` (server-assigned, never client values), so distinct requests
never merge and a replayed callback maps to the same event id. The exception → ledger status mapping is
``kvroute.billing.litellm_events.failure_status`` (one function). Events go to ``UsageRecorder.record`` (journaled
before return); the recorder is closed at interpreter exit (LiteLLM never closes callbacks; the journal covers
a kill).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvroute.billing import cancels
from kvroute.billing.call_facts import CallFacts, money
from kvroute.billing.call_facts import first_given as _first
from kvroute.billing.usage import as_mapping
from kvroute.plugin.adapter.request_ids import CANCELLED, FAILED, SUCCESS, Attempt, RequestIds, RequestState
from kvroute.plugin.adapter.signals import deployment_id, request_metadata

log = logging.getLogger("kvroute.plugin")
UNATTRIBUTED_WARN_EVERY_S = 60.0
CATALOG_TTL_S = 60.0  # how long the price file's cancel billing modes are kept before the catalog is read again


class BillingFeed:
    """Turns hook calls into ledger events and hands them to the recorder (never raises into a hook)."""

    def __init__(self, recorder: Any, ids: RequestIds, *, on_error: Callable[[str], None] | None = None,
                 admission: bool = False) -> None:
        from kvroute.billing import litellm_events

        self.recorder = recorder
        self.ids = ids
        # proxy: only requests LiteLLM's auth admitted (``admit`` from ``async_pre_call_hook``) reach the ledger; a
        # request refused at auth (a wrong key, a key over its budget) is not usage and must not add rows
        self.admission = admission
        self.refused_unadmitted = 0
        self.events = litellm_events
        self._on_error = on_error or (lambda hook: None)
        self._closed = False
        #: backend id -> ledger route kind (``self_hosted``/``marketplace``/``direct``), set by the plugin from its
        #: deployments; ``model_info.kvroute_route_kind`` still wins
        self.kind_of: Callable[[str], str | None] = lambda backend: None
        #: backend id -> the deployment's provider (``model_info.provider``, the engine, the LiteLLM prefix), so a
        #: streamed and a non-streamed attempt of one backend carry the same provider; ``kvroute_provider`` wins
        self.provider_of: Callable[[str], str | None] = lambda backend: None
        #: backend id -> the model the deployment serves (``openai/fake-model`` -> ``fake-model``), for every attempt
        self.served_of: Callable[[str], str | None] = lambda backend: None
        self.db_url: str | None = None
        self.journal: Path | None = None
        self.before_response = 0  # successes recorded before the client got them (streams: before [DONE])
        self.unattributed = 0  # requests booked to no app (their key names none): counted, warned about
        self._cancel_modes: tuple[float, dict[str, str]] | None = None
        self._unattributed_warned_at: float | None = None

    # --- setup -------------------------------------------------------------------------------------
    @classmethod
    def start(cls, settings: Any, ids: RequestIds, *, in_proxy: bool,
              on_error: Callable[[str], None] | None = None) -> BillingFeed | None:
        """The feed for ``settings`` (None when billing is off), with a startup log line saying where it records."""
        target = billing_target(settings, in_proxy=in_proxy)
        if target is None:
            log.info("kvroute billing: off")
            return None
        db, journal, dead = target
        try:
            from kvroute.billing.recorder import UsageRecorder

            recorder = UsageRecorder(db, journal, dead_letter=dead,
                                     fsync_interval_s=settings.billing_fsync_interval_s).start()
        except Exception as exc:
            log.warning("kvroute billing: recorder failed to start: %s", exc)
            if on_error:
                on_error("billing_start")
            return None
        log.warning("kvroute billing: recording to %s (journal %s, dead letters %s)", _safe_url(db), journal, dead)
        feed = cls(recorder, ids, on_error=on_error, admission=in_proxy)
        feed.db_url, feed.journal = db, journal
        feed._install_shutdown()
        return feed

    def _install_shutdown(self) -> None:
        """Close (drain, fsync) the recorder at interpreter exit; a SIGTERM or kill -9 before that is covered by
        the journal, which already holds every recorded event and is replayed by the next start."""
        atexit.register(self.close)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.recorder.close()

    # --- events ------------------------------------------------------------------------------------
    def _catalog(self) -> Any:
        """The ledger's catalog (price books, rate cards, declared backends), or None when unreadable."""
        if not self.db_url:
            return None
        try:
            from sqlalchemy import inspect

            from kvroute.billing.catalog import Catalog
            from kvroute.billing.db import make_engine

            engine = make_engine(self.db_url)  # read only: migrating is the recorder's job
            try:
                tables = inspect(engine)
                if not tables.has_table("cost_rate"):
                    return None  # a ledger not created yet holds no cards
                if "cancel_billing" not in {c["name"] for c in tables.get_columns("backend")}:
                    return None  # a ledger the recorder has not migrated yet: model_list prices until it has
                with engine.connect() as conn:
                    return Catalog.load(conn)
            finally:
                engine.dispose()
        except Exception as exc:
            log.warning("kvroute billing: rate cards unreadable (%s); replicas keep their model_list prices", exc)
            return None

    def rate_cards(self, backend_ids: Iterable[str], at: datetime | None = None) -> dict[str, Any]:
        """The ledger's rate cards (``CostRate``) in force ``at`` (now) for ``backend_ids``: the price file loaded
        with ``kvroute billing load-prices``, read from the same catalog the ledger rates with ({} when unreadable)."""
        return self.price_view(backend_ids, at)[0]

    def price_view(self, backend_ids: Iterable[str], at: datetime | None = None) -> tuple[dict[str, Any],
                                                                                            dict[str, Any]]:
        """(rate cards in force, declared ``BackendIdentity``) of ``backend_ids`` from one read of the catalog."""
        catalog = self._catalog()
        if catalog is None:
            return {}, {}
        when = at or datetime.now(UTC)
        ids = list(backend_ids)
        cards = {b: catalog.rate_for(b, when) for b in ids}
        declared = {b: catalog.identity(b) for b in ids}
        return ({b: r for b, r in cards.items() if r is not None}, {b: d for b, d in declared.items() if d is not None})

    def _record(self, read: Callable[[str], CallFacts | None], *, state: RequestState, attempt: Attempt | None,
                outcome: str, final: bool, backend: str | None) -> bool:
        """Book the event of the facts ``read(app)`` states (None: nothing to book) under the request's app; an
        event that cannot be built goes to the dead letters. Whether it was recorded; never raises."""
        from kvroute.policies.errors import InputError

        facts = None
        try:
            try:
                facts = read(state.app or self.events.UNATTRIBUTED)
                if facts is None:
                    return False
                if state.session_id is not None or state.tags:
                    facts = replace(facts, session_id=state.session_id, tags=state.tags)
                event = self.events.event_from_facts(facts)
            except InputError as exc:  # e.g. a provider usage that contradicts itself: keep it for an operator
                self._dead_letter(facts, state, attempt, backend, outcome, final, exc)
                return False
            if not state.booked:
                state.booked = True
                if state.app is None:
                    self._note_unattributed()
            self.recorder.record(event)
            if attempt is not None:
                attempt.recorded = True
            return True
        except Exception as exc:  # facts nothing foresaw: the event still reaches the dead letters
            log.debug("kvroute billing failed", exc_info=True)
            self._on_error("billing")
            self._dead_letter(facts, state, attempt, backend, outcome, final, exc)
            return False

    def _callback_facts(self, kwargs: Mapping[str, Any], response: Any, app: str, *, outcome: str,
                        state: RequestState, attempt: Attempt | None, final: bool, backend: str | None,
                        start: Any = None, end: Any = None, exception: Any = None, model: str | None = None,
                        model_info: Mapping[str, Any] | None = None) -> CallFacts | None:
        """The facts of a LiteLLM payload, with what kvroute knows first: the request, the attempt and the
        deployment's route kind, provider and served model (``exception``, ``model`` and ``model_info``: the
        attempt's, when the payload holds the request's or none)."""
        route_kind = _dict_get(kwargs, "kvroute_route_kind", model_info) or (self.kind_of(backend) if backend else None)
        provider = _dict_get(kwargs, "kvroute_provider", model_info) or (self.provider_of(backend) if backend else None)
        facts = self.events.facts_from_callback(
            kwargs, response, outcome=outcome, attempt=attempt.number if attempt else None, final=final,
            request_id=state.request_id, app_id=app, backend_id=backend, route_kind=route_kind, provider=provider,
            served_model=self.served_of(backend) if backend else None, end_time=end, exception=exception, model=model,
            start_time=start if start is not None else self._sent_at(attempt))
        if facts is not None and backend == self.events.ROUTER_BACKEND:  # nothing was called: no provider
            facts = replace(facts, provider=self.events.ROUTER_PROVIDER)
        return facts

    def _deployment(self, backend: str, *infos: Any) -> tuple[str | None, str | None]:
        """(route kind, provider) of ``backend``: what its ``model_info`` declares (``kvroute_route_kind``,
        ``kvroute_provider``; the first of ``infos`` that holds one), else what the fleet knows."""
        return (_declared(infos, "kvroute_route_kind") or self.kind_of(backend),
                _declared(infos, "kvroute_provider") or self.provider_of(backend))

    def _note_unattributed(self) -> None:
        """Count a request booked ``unattributed`` and say so in the log, at most once a minute."""
        self.unattributed += 1
        now = time.monotonic()
        if self._unattributed_warned_at is None or now - self._unattributed_warned_at >= UNATTRIBUTED_WARN_EVERY_S:
            self._unattributed_warned_at = now
            log.warning("kvroute billing: %d request(s) booked as app 'unattributed' so far: their key names no app "
                        "(key metadata kvroute_app, a team, a key alias, or kvroute.apps with "
                        "custom_auth: kvroute.plugin.adapter.app_keys.auth)", self.unattributed)

    def _dead_letter(self, facts: CallFacts | None, state: RequestState, attempt: Attempt | None,
                     backend: str | None, outcome: str, final: bool, exc: Exception) -> None:
        """An attempt whose facts cannot make a valid event: its ids and raw usage (never prompt text)."""
        try:
            line = {"request_id": state.request_id, "attempt": attempt.number if attempt else len(state.attempts),
                    "final": final, "status": outcome if outcome in self.events.STATUSES else "success",
                    "backend_id": facts.backend_id if facts else backend,
                    "served_model": facts.served_model if facts else None,
                    "provider": facts.provider if facts else None,
                    "occurred_at": datetime.now(UTC).isoformat(),
                    "raw_usage": dict(facts.usage) if facts and facts.usage else {}}
            if state.app:
                line["app_id"] = state.app
            self.recorder.dead_letter.append(json.dumps(line, default=str), f"invalid event: {exc}", "callback")
            self.recorder.note_dead_letter()
        except Exception:
            self._on_error("billing")

    def attempt_started(self, attempt: Attempt, kwargs: Mapping[str, Any]) -> None:
        """The attempt is going upstream now (``async_pre_call_deployment_hook``)."""
        attempt.sent = True
        info = kwargs.get("model_info")
        attempt.model_info = info if isinstance(info, dict) else {}  # the deployment's own dict: no copy
        attempt.served = kwargs.get("model")

    def _sent_at(self, attempt: Attempt | None) -> datetime | None:
        """When ``attempt`` went upstream, as a UTC time (None: it was never sent)."""
        return self.ids.wall(attempt.started) if attempt is not None and attempt.sent else None

    def admit(self, data: Mapping[str, Any]) -> None:
        """``async_pre_call_hook`` (proxy, after LiteLLM's auth): the request may reach the ledger; stamp its id."""
        meta = request_metadata(data)
        if isinstance(meta, dict):
            self.ids.begin(meta)

    def _unrouted_state(self, meta: Any) -> RequestState | None:
        """The state of a request that failed before any pick: new for an admitted or SDK request, None (not
        usage, counted) for a proxy request that never passed auth."""
        if not isinstance(meta, dict):
            return None
        if self.admission and self.ids.request_of(meta) is None:
            self.refused_unadmitted += 1
            return None
        return self.ids.begin(meta)

    def success(self, kwargs: Mapping[str, Any], response: Any, start: Any, end: Any, ticket_id: str | None = None,
                *, found: tuple[RequestState, Attempt] | None = None) -> None:
        """``async_log_success_event``: the final success (a no-op when the pre-response record stored it);
        ``found``: the attempt the hook already resolved (else ``ticket_id``'s)."""
        found = found or self.ids.attempt_of(ticket_id)
        if found is None:
            meta = request_metadata(kwargs)
            if meta is None:
                return
            state = self.ids.begin(meta)  # no pick ran (routing off): stamp the id so a replay maps to it
            attempt = state.latest(backend=deployment_id(kwargs))
            if attempt is None:
                _, attempt = self.ids.new_attempt(meta, str(kwargs.get("model") or ""), deployment_id(kwargs))
        else:
            state, attempt = found
        if state.final == CANCELLED or attempt.hedge_lost or (state.final == SUCCESS and attempt.recorded):
            return  # recorded before the response went out (same event id), or its client left: nothing to add
        if _client_left(kwargs):  # LiteLLM's account of a stream its client left: what it had is what was relayed
            counted = _get_int(getattr(response, "usage", None), "completion_tokens")
            if self.cancelled(kwargs, attempt.streamed or counted, getattr(response, "usage", None)):
                return
        state.book_final(SUCCESS)
        backend = deployment_id(kwargs) or attempt.backend

        def read(app: str) -> CallFacts | None:
            return self._callback_facts(kwargs, response, app, outcome="success", state=state, attempt=attempt,
                                        final=True, backend=backend, start=start, end=end)

        self._record(read, state=state, attempt=attempt, outcome="success", final=True, backend=backend)

    def pre_response(self, data: Mapping[str, Any], response: Any, *, hidden: Any = None,
                     streamed: bool = False) -> None:
        """Record the final success before the proxy answers: ``async_post_call_success_hook`` (the response), or
        the end of a stream (the chunk that carries ``usage``, ``hidden`` from the stream wrapper)."""
        meta = request_metadata(data)
        state = self.ids.state(meta)
        if hidden is None:
            hidden = getattr(response, "_hidden_params", None)
        hidden = hidden if isinstance(hidden, Mapping) else {}
        if not hidden.get("model_id"):
            own = getattr(response, "_hidden_params", None)
            hidden = {**(own if isinstance(own, Mapping) else {}), **hidden}
        model_id = hidden.get("model_id")
        if state is None or getattr(response, "usage", None) is None:
            return
        # the deployment that answered; without its id, the last attempt that went upstream is the one answering
        attempt = state.latest(backend=str(model_id)) if model_id else next(
            (a for a in reversed(state.attempts) if a.sent and a.backend), None)
        if attempt is None or not attempt.sent:
            return
        backend = str(model_id or attempt.backend)
        end = datetime.now(UTC)

        def read(app: str) -> CallFacts | None:
            usage, reported, finish = self.events.read_response(response)
            return self._attempt_facts(
                state, attempt, backend, data, meta, app, end, provider=hidden.get("custom_llm_provider"),
                final=True, usage=as_mapping(usage), usage_provider=hidden.get("custom_llm_provider"),
                reported_cost=reported, litellm_cost=money(_first(hidden.get("response_cost"))),
                finish_reason=finish, streamed=streamed)

        if self._record(read, state=state, attempt=attempt, outcome="success", final=True, backend=backend):
            self.before_response += 1
        state.book_final(SUCCESS)

    def cancelled(self, data: Mapping[str, Any], relayed: int = 0, usage: Any = None) -> bool:
        """The client went away: book the attempt serving the request as its final ``cancelled`` attempt, once,
        with what its provider bills (``kvroute.billing.cancels``): the prompt (the provider's early ``usage``
        when a chunk carried one, else counted) and the ``relayed`` output. Whether it booked it (False: no
        attempt reached a provider, or the request already has its outcome)."""
        meta = request_metadata(data)
        state = self.ids.state(meta)
        if state is None or state.final is not None:
            return False
        attempt = next((a for a in reversed(state.attempts) if a.sent and a.backend and not a.hedge_lost), None)
        if attempt is None or attempt.recorded:
            return False
        state.book_final(CANCELLED)  # even if its row cannot be built: nothing else ends this request
        return self._book_cancel(state, attempt, data, relayed, usage, final=True, error_type=cancels.CLIENT_LEFT)

    def hedge_lost(self, data: Mapping[str, Any], attempt: Attempt, produced: int, *, primary: bool) -> bool:
        """``attempt`` lost a hedge race and was closed after ``produced`` content chunks: book it non-final,
        ``cancelled`` with ``error_type: hedge_lost``, with what its provider bills for a cancel (absorbed unless
        the price rule bills failed attempts); ``primary``: it was the request's first route (the hedge won).
        Whether it was booked."""
        state = self.ids.state(request_metadata(data))
        if state is None or attempt.recorded or not attempt.backend:
            return False
        attempt.hedge_lost = True
        return self._book_cancel(state, attempt, data, produced, None, final=False, error_type=cancels.HEDGE_LOST,
                                 role="primary" if primary else "hedge")

    def _book_cancel(self, state: RequestState, attempt: Attempt, data: Mapping[str, Any], relayed: int,
                     usage: Any, *, final: bool, error_type: str, role: str | None = None) -> bool:
        """Book ``attempt`` as ``cancelled`` with the tokens its provider bills for a cancel."""
        meta = request_metadata(data) or {}
        backend = str(attempt.backend)
        mode = self.cancel_billing_of(backend, attempt.model_info)
        prompt, cached, source = _cancelled_prompt(usage, data, attempt.served)
        max_tokens = _first(data.get("max_completion_tokens"), data.get("max_tokens"))
        billed = cancels.cancelled_usage(mode, prompt_tokens=prompt, cached_tokens=cached, relayed=relayed,
                                         max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                                         prompt_source=source)
        if role is not None:
            billed["kvroute_hedge"] = role  # which side of a hedge race lost (the reports' ``hedge_wins``)
        end = datetime.now(UTC)

        def read(app: str) -> CallFacts | None:
            return self._attempt_facts(
                state, attempt, backend, data, meta, app, end, outcome="cancelled", final=final, usage=billed,
                litellm_cost=self.events.cut_stream_usage(billed["prompt_tokens"], billed["completion_tokens"],
                                                          _prices(attempt.model_info))[1],
                http_status=499 if final else None,
                error_type=error_type, streamed=bool(data.get("stream")))

        return self._record(read, state=state, attempt=attempt, outcome="cancelled", final=final, backend=backend)

    def _attempt_facts(self, state: RequestState, attempt: Attempt, backend: str, data: Mapping[str, Any],
                       meta: Mapping[str, Any], app: str, end: datetime, *, provider: str | None = None,
                       **observed: Any) -> CallFacts | None:
        """The facts of an attempt kvroute saw end itself (an answer before the response, a cancel): the
        deployment's served model, route kind and provider (``provider``: the payload's, when the deployment
        declares none), the request's ids and client, and ``observed`` (None without a served model)."""
        served = self.served_of(backend) or _served_model(attempt.served)
        if served is None:
            return None
        kind, declared = self._deployment(backend, attempt.model_info, meta.get("model_info"))
        return CallFacts(
            request_id=state.request_id, app_id=app, served_model=served, backend_id=backend,
            requested_model=_first(data.get("model"), meta.get("model_group")), provider=_first(declared, provider),
            route_kind=kind, attempt=attempt.number, start=self._sent_at(attempt), end=end,
            fallback_depth=meta.get("fallback_depth"), end_user=data.get("user"),
            api_key_hash=meta.get("user_api_key_hash"), **observed)

    def cancel_billing_of(self, backend: str, model_info: Mapping[str, Any] | None = None) -> str:
        """What ``backend``'s provider bills for a cancelled call: its ``model_info.kvroute_cancel_billing``, else
        the price file's declaration, else the provider's known mode (``cancels.cancel_billing_for``)."""
        declared = _declared((model_info,), "kvroute_cancel_billing")
        if declared is None:
            declared = self._declared_cancel_modes().get(backend)
        try:
            return cancels.cancel_billing_for(self.provider_of(backend), declared)
        except Exception:  # a typo in model_info: the provider's own mode, said once per backend
            log.warning("kvroute billing: %s has an unknown cancel_billing %r; using its provider's",
                        backend, declared)
            return cancels.cancel_billing_for(self.provider_of(backend))

    def _declared_cancel_modes(self) -> Mapping[str, str]:
        """backend id -> the cancel billing its price file declared, read from the catalog at most once a minute."""
        now = time.monotonic()
        if self._cancel_modes is None or now - self._cancel_modes[0] >= CATALOG_TTL_S:
            catalog = self._catalog()
            modes = {b: i.cancel_billing for b, i in (catalog.backends.items() if catalog else ())
                     if i.cancel_billing}
            self._cancel_modes = (now, modes)
        return self._cancel_modes[1]

    def stream_cut(self, request_data: Mapping[str, Any], relayed: int) -> None:
        """The proxy stream failed after ``relayed`` chunks with output went to the client: they are the output
        the current attempt was billed for (its failure is recorded by the failure hooks, with that cost)."""
        try:
            state = self.ids.state(request_metadata(request_data))
            # the attempt relaying the stream: the last one sent upstream (the request's metadata may still name
            # an earlier hop's ticket after a fallback)
            attempt = next((a for a in reversed(state.attempts) if a.sent and a.backend), None) if state else None
            if attempt is not None:
                attempt.streamed = max(attempt.streamed, relayed)
        except Exception:
            self._on_error("billing")

    def _paid(self, facts: CallFacts | None, attempt: Attempt, payload: Mapping[str, Any]) -> CallFacts | None:
        """``facts`` of a failed attempt with what the provider bills for it: nothing for one that sent no output;
        for a stream cut after output went out (the chunks the proxy relayed, else LiteLLM's count of the partial
        stream in the failure ``payload``), the usage and cost of ``litellm_events.cut_stream_usage``."""
        if facts is None:
            return None
        slo = payload.get("standard_logging_object")
        slo = slo if isinstance(slo, Mapping) else {}
        output, prompt = attempt.streamed, slo.get("prompt_tokens")
        if not output:  # LiteLLM's own count of a partial stream, in its failure payload
            counted = slo.get("completion_tokens")
            output = counted if isinstance(counted, int) and not isinstance(counted, bool) and counted > 0 else 0
        if not output:
            return facts
        if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt <= 0:
            prompt = _prompt_tokens(payload, attempt.served)
        usage, cost = self.events.cut_stream_usage(prompt, output, _prices(attempt.model_info))
        return replace(facts, usage=usage, reported_cost=None, finish_reason=None,
                       litellm_cost=cost if cost is not None else facts.litellm_cost)

    def attempt_failed(self, request_data: Mapping[str, Any], exception: BaseException, ticket_id: str | None = None,
                       *, found: tuple[RequestState, Attempt] | None = None, status: str | None = None) -> None:
        """``async_post_call_failure_deployment_hook``: one failed upstream attempt, non-final (``status``: the
        ledger status of the verdict the hook already reached; ``found``: the attempt it resolved)."""
        found = found or self.ids.attempt_of(ticket_id)
        if found is None:
            return
        state, attempt = found
        if status is None:
            status = self.events.exception_status(exception, backend_called=True)[0]  # the per-attempt hook
        if status == "cancelled" and self.cancelled(request_data):
            return  # the client went away: booked once, final, with what its provider bills
        backend = deployment_id(request_data) or attempt.backend

        def read(app: str) -> CallFacts | None:
            return self._paid(self._callback_facts(request_data, None, app, outcome=status, state=state,
                                                   attempt=attempt, final=False, backend=backend, exception=exception),
                              attempt, request_data)

        self._record(read, state=state, attempt=attempt, outcome=status, final=False, backend=backend)

    def superseded(self, ticket_id: str | None, request: Mapping[str, Any] | None = None) -> None:
        """A new pick arrived while the previous attempt had no outcome: record it once (``request``: the
        request's data, for its key, end user and stream flag).

        LiteLLM reports every upstream call's failure through a hook before it retries or falls back, so an
        attempt no hook described was refused before any call (its budget, a pre-call check): ``no_route`` on
        ``router``, as the request's own outcome is booked when LiteLLM refuses it. Only an attempt whose
        stream already relayed output certainly reached its provider: ``provider_failure`` on its backend,
        paid for that output (``_paid``)."""
        found = self.ids.attempt_of(ticket_id)
        if found is None:
            return
        state, attempt = found
        if not (attempt.sent and not attempt.recorded and attempt.backend):
            return
        data = request if request is not None else {}
        meta = request_metadata(data) or {}
        sent_as = attempt.served or attempt.group
        if not attempt.streamed:
            router = self.events.ROUTER_BACKEND

            def read_refused(app: str) -> CallFacts | None:
                return self._request_facts(state, app, meta, None, outcome="no_route", final=False,
                                           model=attempt.group or sent_as, user=data.get("user"), backend=router,
                                           route_kind="direct", provider=None, key="", attempt=attempt)

            self._record(read_refused, state=state, attempt=attempt, outcome="no_route", final=False,
                         backend=router)
            return
        backend = attempt.backend

        def read(app: str) -> CallFacts | None:
            served = _first(self.served_of(backend), sent_as)
            if served is None:
                return None
            facts = CallFacts(
                request_id=state.request_id, app_id=app, served_model=served, backend_id=backend,
                requested_model=sent_as,
                route_kind=_declared((attempt.model_info,), "kvroute_route_kind") or self.kind_of(backend),
                provider=_declared((attempt.model_info,), "kvroute_provider") or self.provider_of(backend),
                outcome="provider_failure", final=False, attempt=attempt.number, start=self._sent_at(attempt),
                end_user=data.get("user"), api_key_hash=meta.get("user_api_key_hash"),
                streamed=bool(data.get("stream")))
            return self._paid(facts, attempt, {})

        self._record(read, state=state, attempt=attempt, outcome="provider_failure", final=False, backend=backend)

    def logged_failure(self, kwargs: Mapping[str, Any], exception: Any, *, status: str | None = None) -> None:
        """``async_log_failure_event``: a router-level hop as ``no_route``, or an attempt nothing else recorded
        (``status``: the ledger status of the verdict the hook already reached)."""
        meta = request_metadata(kwargs)
        state = self.ids.state(meta)
        if status is None:
            status = self.events.exception_status(exception)[0]
        if status == "cancelled" and self.cancelled(kwargs):
            return
        slo = kwargs.get("standard_logging_object")
        slo = slo if isinstance(slo, Mapping) else {}
        group = str(slo.get("model_group") or kwargs.get("model") or "")
        if status == "no_route":
            if state is None:
                state = self._unrouted_state(meta)
                if state is None:
                    return
            hop = state.latest(group=group, unrecorded=True, hop=True) if group else None
            router = self.events.ROUTER_BACKEND

            def read_hop(app: str) -> CallFacts | None:
                return self._request_facts(state, app, meta, exception, outcome="no_route", final=False,
                                           model=group or "unknown", user=kwargs.get("user"), backend=router,
                                           route_kind="direct", provider=None, key=f"no_route:{group}", attempt=hop)

            self._record(read_hop, state=state, attempt=hop, outcome="no_route", final=False, backend=router)
            return
        if state is None:
            return
        attempt = state.latest(backend=deployment_id(kwargs), unrecorded=True)
        if attempt is not None and attempt.sent:
            sent = attempt

            def read(app: str) -> CallFacts | None:
                return self._paid(self._callback_facts(kwargs, None, app, outcome=status, state=state,
                                                       attempt=sent, final=False, backend=sent.backend,
                                                       exception=exception), sent, kwargs)

            self._record(read, state=state, attempt=attempt, outcome=status, final=False, backend=attempt.backend)

    def request_failed(self, data: Mapping[str, Any], exception: BaseException, *, status: str | None = None) -> None:
        """``async_post_call_failure_hook`` (proxy): the request failed for the client -- its final outcome row
        (``status``: the ledger status of the verdict the hook read or reached)."""
        meta = request_metadata(data)
        state = self.ids.state(meta)
        if status is None:
            status = self.events.exception_status(exception)[0]
        if status == "cancelled" and self.cancelled(data):
            return  # the client went away (LiteLLM's 499): its attempt is the request's outcome
        if state is None:
            if status != "no_route":
                return  # never routed (validation): not usage
            state = self._unrouted_state(meta)
            if state is None:
                return  # refused at auth: not usage
        if state.final is not None:
            return
        last = state.latest(unrecorded=False)
        if last is not None and last.sent and last.backend and not last.recorded and last.streamed:
            # a stream cut after output went out (no per-attempt hook runs for it): the attempt's own row, paid
            cut = last

            def read_cut(app: str) -> CallFacts | None:
                return self._paid(self._callback_facts(data, None, app, outcome=status, state=state, attempt=cut,
                                                       final=False, backend=cut.backend, exception=exception,
                                                       model=cut.served or cut.group, model_info=cut.model_info or {}),
                                  cut, data)

            self._record(read_cut, state=state, attempt=last, outcome=status, final=False, backend=last.backend)
        # a router-level outcome (no deployment, a budget) called no upstream, whatever kvroute had picked
        routed = last is not None and bool(last.backend) and status != "no_route"
        backend = last.backend if routed else self.events.ROUTER_BACKEND
        model = str(data.get("model") or (last.group if last else "unknown"))

        def read_outcome(app: str) -> CallFacts | None:
            kind, provider = self._deployment(backend, (last.model_info if last else None) or {},
                                              meta.get("model_info"))
            return self._request_facts(state, app, meta, exception, outcome=status, final=True, model=model,
                                       user=data.get("user"), backend=backend, route_kind=kind, provider=provider,
                                       key="outcome")

        if self._record(read_outcome, state=state, attempt=None, outcome=status, final=True, backend=backend):
            state.book_final(FAILED)

    def _request_facts(self, state: RequestState, app: str, meta: Mapping[str, Any], exception: Any, *,
                       outcome: str, final: bool, model: str, user: Any, backend: str, route_kind: str | None,
                       provider: str | None, key: str, attempt: Attempt | None = None) -> CallFacts | None:
        """The facts of a row no upstream answer describes: a router-level hop (``attempt``, else one told apart by
        ``key``) or the request's final outcome (``key``), sent as ``model``."""
        served = _first(self.served_of(backend), model)
        if served is None:
            return None
        if backend == self.events.ROUTER_BACKEND:  # nothing was called: no provider
            provider = self.events.ROUTER_PROVIDER
        http_status, error_type = self.events.read_error(exception)
        number, attempt_key = (attempt.number, None) if attempt else (len(state.attempts), attempt_key_for(key))
        return CallFacts(
            request_id=state.request_id, app_id=app, served_model=served, backend_id=backend,
            requested_model=_first(meta.get("model_group"), model), provider=provider, route_kind=route_kind,
            outcome=outcome, final=final, attempt=number, attempt_key=attempt_key, http_status=http_status,
            error_type=error_type, start=self._sent_at(attempt),
            fallback_depth=meta.get("fallback_depth"), end_user=user, api_key_hash=meta.get("user_api_key_hash"))


class RecorderCollector:
    """Prometheus view of the recorder: events recorded / stored / dead-lettered, journal backlog, database up."""

    def __init__(self, feed: BillingFeed) -> None:
        self.feed = feed
        self.recorder = feed.recorder

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily("kvroute_billing_recorded_before_response",
                                  "Successes journaled before the proxy answered", value=self.feed.before_response)
        yield CounterMetricFamily("kvroute_billing_unattributed_requests",
                                  "Requests booked as app 'unattributed' (their key names no app)",
                                  value=self.feed.unattributed)
        yield CounterMetricFamily("kvroute_billing_refused_unadmitted",
                                  "Failed requests LiteLLM's auth never admitted (not usage: no ledger row)",
                                  value=self.feed.refused_unadmitted)
        st = self.recorder.stats
        for name, doc, value in (
                ("kvroute_billing_events_recorded", "Usage events journaled on the request path", st.recorded),
                ("kvroute_billing_events_inserted", "Usage events stored in the ledger (new rows)", st.inserted),
                ("kvroute_billing_events_dead_lettered", "Usage events set aside in the dead-letter file",
                 st.dead_lettered),
                ("kvroute_billing_journal_errors", "Journal writes that failed (event kept in memory)",
                 st.journal_errors)):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("kvroute_billing_journal_pending_bytes", "Journal bytes not yet in the ledger",
                                value=self.recorder.pending_bytes)
        yield GaugeMetricFamily("kvroute_billing_db_up", "1 while the billing database is reachable",
                                value=1.0 if self.recorder.db_available else 0.0)


def attempt_key_for(key: str) -> str:
    """An attempt key the ledger stores as given: a client's model name in it (``no_route:<model>``) may hold a
    NUL or run past the column; such a key is cleaned and bounded, a hash suffix keeping distinct names distinct."""
    from kvroute.billing.events import fit_text

    return fit_text("attempt_key", key) or key


def _dict_get(kwargs: Mapping[str, Any], key: str, model_info: Mapping[str, Any] | None = None) -> Any:
    """``key`` of the deployment's ``model_info`` in a hook payload (``model_info``: the attempt's, in place of
    the payload's top-level one; None when absent)."""
    params = kwargs.get("litellm_params") if isinstance(kwargs.get("litellm_params"), Mapping) else {}
    top = model_info if model_info is not None else kwargs.get("model_info")
    meta = (params.get("metadata"), kwargs.get("metadata"))
    return _declared((params.get("model_info"), top, *(m.get("model_info") if isinstance(m, Mapping) else None
                                                       for m in meta)), key)


def _declared(infos: Iterable[Any], key: str) -> Any:
    """``key`` of the first ``model_info`` among ``infos`` that holds it (None when none does)."""
    for info in infos:
        if isinstance(info, Mapping) and info.get(key) is not None:
            return info.get(key)
    return None


def _served_model(model: Any) -> str | None:
    """``openai/fake-model`` → ``fake-model`` (how LiteLLM's logging payload names the served model)."""
    if not isinstance(model, str) or not model:
        return None
    return model.split("/", 1)[1] if "/" in model else model


def billing_target(settings: Any, *, in_proxy: bool) -> tuple[str, Path, Path] | None:
    """(ledger URL, journal folder, dead-letter folder), or None when billing is off.

    On by default in the proxy: where ``kvroute.billing.location.ledger_location`` puts it for these settings (the
    function ``kvroute report``/``billing`` resolve the ledger with), i.e. ``KVROUTE_BILLING_DB``, else
    ``<data dir>/billing.db`` (``KVROUTE_DATA_DIR``, default ``./.kvroute``); ``KVROUTE_BILLING_DB=off``
    disables. In the SDK, on only when asked (``billing: true`` or a database). A data directory that is not a
    writable folder raises ``ConfigError`` naming ``kvroute.data_dir``.
    """
    from kvroute.billing.location import ledger_location, prepare_data_dir

    where = ledger_location(settings.data_dir, settings.billing_db, settings.billing_spool)
    if where.db_url is None or not (in_proxy or settings.billing or (settings.billing_db or "").strip()):
        return None
    prepare_data_dir(where.data_dir)
    return where.db_url, where.journal, where.dead_letters


def describe_target(db: str, journal: Path | None) -> str:
    """Where billing records, for people: ``sqlite .kvroute/billing.db (journal .kvroute/journal)`` (paths under
    the working directory relative to it), ``postgresql+psycopg://user@host/db (journal ...)`` (no password)."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(db if "://" in db else f"sqlite:///{db}")
    except Exception:
        return "an unparsable database URL"
    where = (f"sqlite {_near(Path(url.database))}" if url.get_backend_name() == "sqlite" and url.database
             else _safe_url(db))
    return f"{where} (journal {_near(journal)})" if journal is not None else where


def _near(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute."""
    absolute = Path(os.path.abspath(path.expanduser()))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def _safe_url(url: str) -> str:
    """The URL without its password (for the startup line)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def _prompt_tokens(data: Mapping[str, Any], served: str | None) -> int:
    """The request's prompt tokens as LiteLLM counts them for the served model (its estimate for streams without
    usage); 0 when the request holds no messages or prompt."""
    try:
        import litellm

        messages = data.get("messages")
        if isinstance(messages, list):
            return int(litellm.token_counter(model=served or "", messages=messages))
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            return int(litellm.token_counter(model=served or "", text=prompt))
    except Exception:
        log.debug("kvroute billing: prompt tokens of a cut stream unknown", exc_info=True)
    return 0


def _client_left(kwargs: Mapping[str, Any]) -> bool:
    """Whether LiteLLM marked the request's client as gone (``client_disconnected`` in any of its metadata)."""
    params = kwargs.get("litellm_params")
    return any(isinstance(m, Mapping) and m.get("client_disconnected") is True
               for m in (kwargs.get("metadata"), kwargs.get("litellm_metadata"),
                         params.get("metadata") if isinstance(params, Mapping) else None))


def _get_int(obj: Any, name: str) -> int:
    """``obj.name`` (or ``obj[name]``) when it is a non-negative int, else 0."""
    value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _cancelled_prompt(usage: Any, data: Mapping[str, Any], served: str | None) -> tuple[int, int, str]:
    """(prompt tokens, cached ones, source) of a cancelled attempt: the provider's early usage when a chunk
    carried one (``reported``), else the deployment's tokenizer (``counted``), else four characters a token."""
    plain = as_mapping(usage) if usage is not None else {}
    reported = plain.get("prompt_tokens") if isinstance(plain, Mapping) else None
    if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
        details = plain.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        return reported, cached if isinstance(cached, int) and not isinstance(cached, bool) else 0, "reported"
    counted = _prompt_tokens(data, served)
    if counted > 0:
        return counted, 0, "counted"
    text = json.dumps(data.get("messages") or data.get("prompt") or "", default=str)
    return max(len(text) // 4, 1), 0, "estimated"


_PRICE_KEYS = ("input_cost_per_token", "output_cost_per_token")


def _prices(model_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The deployment's per-token prices: its ``model_info``, else what LiteLLM registered under its id."""
    info = model_info if isinstance(model_info, Mapping) else {}
    found = {k: info.get(k) for k in _PRICE_KEYS if info.get(k) is not None}
    if len(found) < len(_PRICE_KEYS) and info.get("id") is not None:
        with contextlib.suppress(Exception):
            import litellm

            entry = litellm.model_cost.get(str(info["id"])) or {}
            found = {k: found.get(k, entry.get(k)) for k in _PRICE_KEYS}
    return {k: v for k, v in found.items() if v is not None}
