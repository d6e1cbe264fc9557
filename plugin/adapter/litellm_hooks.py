"""The LiteLLM callback: pins each request to the policy's pick and feeds outcomes back (proxy and SDK alike).

Request flow (verified on LiteLLM 1.110.2): ``async_filter_deployments`` (pick; one call per attempt) →
``async_pre_call_deployment_hook`` (the deployment really used) → ``async_log_success_event`` or
``async_post_call_failure_deployment_hook`` (per attempt) + ``async_log_failure_event`` (request level).
Attempts are linked through a routing id written into the request's metadata dict (shared by every hook).
Every hook keeps LiteLLM's signature, resolves its attempt record once, catches its own errors and counts them.
The hooks translate LiteLLM's payloads into an attempt's events (``attempt_events``: picked, sent, first token,
answered, ended), which the ledger (``ledger_listener``), routing and the metrics (``outcomes``) listen to;
``pick`` makes the choice, ``tenancy`` finds tenant, salt and app, ``billing_feed`` books the request-level
events, ``wiring`` sets up and ``status_view`` reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvroute.plugin.adapter import outcomes, pick, status_view, tenancy, wiring
from kvroute.plugin.adapter.attempt_events import AttemptEvents, Ended, How, Payload
from kvroute.plugin.adapter.billing_feed import BillingFeed
from kvroute.plugin.adapter.decision_log import DecisionLog
from kvroute.plugin.adapter.deployments import Backend, Deployments, litellm_cost_map
from kvroute.plugin.adapter.hedge import Hedges, hedged
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.adapter.parts import Parts
from kvroute.plugin.adapter.peer_filters import PeerFilters
from kvroute.plugin.adapter.request_ids import ATTEMPT_KEY, TICKET_KEY, Attempt, RequestIds, RequestState
from kvroute.plugin.adapter.rules import RuleBook
from kvroute.plugin.adapter.signals import HealthAdapter, chunk_has_output, deployment_id, request_metadata
from kvroute.plugin.settings import GroupSettings, KvrouteSettings
from kvroute.policies import ChainKey, Router
from kvroute.policies.base import Policy
from kvroute.policies.errors import ConfigError

log = logging.getLogger("kvroute.plugin")

RID_KEY = TICKET_KEY  # the ticket id of the current attempt (kvroute.plugin.adapter.request_ids)
__all__ = ["ATTEMPT_KEY", "RID_KEY", "KvrouteCallback", "get_callback"]
MAX_REQUEST_STATES = 100_000  # requests whose attempts kvroute remembers (~0.3 KB each)


class KvrouteCallback(CustomLogger):
    """KV-cache-aware routing, health filtering, metrics and billing hooks for LiteLLM (proxy and SDK)."""

    def __init__(self, settings: KvrouteSettings | None = None, *, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, proxy_config: str | None = None,
                 health: HealthAdapter | None = None, mount: bool = True) -> None:
        super().__init__()
        self.parts = Parts(settings, proxy_config, metrics, health, mount)  # built out by ``wiring.build``
        self.clock = clock
        self._ready = False
        self.routers: dict[str, Router] = {}
        self.fleet = Deployments(litellm_cost_map, group_kind=self._group_kind)
        self.rules = RuleBook()
        self.ids = RequestIds(MAX_REQUEST_STATES, clock=clock)  # the one per-request store (attempts, verdicts...)
        self.peer_filters = PeerFilters(self)  # LiteLLM's other filters (budgets...) narrow before the pick
        self.billing: BillingFeed | None = None
        self.hedges: Hedges | None = None  # the groups with a ``hedge:`` block (set-up builds it)
        self._apps: tenancy.AppNames | None = None
        self.attached: dict[int, int] = {}  # policy object -> how many backends it was last bound to
        self.precise: dict[str, Any] = {}
        self.scrapers: dict[str, Any] = {}
        self.last_expire = clock()  # when the routers' old picks were last expired
        self.recorder: Any = None
        self.decision_log: DecisionLog | None = None
        self.billing_target: tuple[str, Path, Path] | None = None
        self.mounted: list[str] = []
        self.chain: ChainKey | None = None
        self.chain_source = ""
        self.chain_fingerprint = ""

    @property
    def tickets(self) -> dict[str, Attempt]:
        """Routed attempts awaiting their outcome, by ticket id (a snapshot)."""
        return {a.ticket: a for a in self.ids.open_attempts()}

    # --- lazy set-up (the proxy imports the module before its config and router exist) -----------
    @property
    def settings(self) -> KvrouteSettings:
        self._setup()
        assert self.parts.settings is not None
        return self.parts.settings

    @property
    def metrics(self) -> Metrics:
        if self.parts.metrics is None:
            self._setup()
        assert self.parts.metrics is not None
        return self.parts.metrics

    @property
    def health(self) -> HealthAdapter:
        self._setup()
        assert self.parts.health is not None
        return self.parts.health

    @property
    def events(self) -> AttemptEvents:
        """An attempt's events and their listeners (built on set-up)."""
        self._setup()
        assert self.parts.events is not None
        return self.parts.events

    @property
    def shared(self) -> Any:
        """The Redis-shared state (None: not configured, unreachable, or not set up yet)."""
        return self.parts.shared

    def _setup(self) -> None:
        """Load settings and start side services once; a bad config raises ``ConfigError`` (and retries later)."""
        if self._ready:
            return
        self._ready = True
        try:
            self._build()
        except BaseException:
            self._ready = False
            raise

    def _build(self) -> None:
        wiring.build(self)

    def _group_kind(self, group: str) -> str:
        s = self.parts.settings
        return s.group(group).kind if s is not None else "auto"

    # --- routers -----------------------------------------------------------------------------------
    def router_for(self, group: str, backends: Sequence[Backend]) -> Router:
        """One ``kvroute.policies.Router`` per model group, built on first use."""
        router = self.routers.get(group)
        return router if router is not None else wiring.router_for(self, group, backends)

    def attach(self, router: Router, policy: Policy, backends: Sequence[Backend]) -> None:
        """Bind ``policy`` to its group's fleet (``wiring.attach``)."""
        wiring.attach(self, router, policy, backends)

    # --- the pick ----------------------------------------------------------------------------------
    async def async_filter_deployments(self, model: str, healthy_deployments: list, messages: Any,
                                       request_kwargs: dict | None = None, parent_otel_span: Any = None) -> list:
        try:
            healthy_deployments = await self.peer_filters.narrow(model, healthy_deployments, messages,
                                                                 request_kwargs)
        except Exception:
            return healthy_deployments  # a peer refused them all: LiteLLM's own run of it raises its error
        try:
            precise = None
            group = self.precise.get(str(model))
            if group is not None and healthy_deployments:
                kwargs = request_kwargs if isinstance(request_kwargs, dict) else {}
                tenant, salt = self.tenant_salt(self.settings.group(str(model)), request_metadata(kwargs) or {},
                                                kwargs)
                request = await group.afingerprint(pick.prompt_source(kwargs, messages), model=str(model),
                                                   tenant=tenant, salt=salt)
                precise = (request, salt) if request is not None else None
            return pick.pick(self, model, healthy_deployments, messages, request_kwargs, precise=precise)
        except Exception:
            log.debug("kvroute filter failed", exc_info=True)
            self.count_error("filter")
            return healthy_deployments

    def filter(self, model: str, healthy: list, messages: Any, request_kwargs: dict | None) -> list:
        """Synchronous core of ``async_filter_deployments`` (the SDK and the proxy share it)."""
        return pick.pick(self, model, healthy, messages, request_kwargs)

    def tenant_salt(self, gs: GroupSettings, meta: Mapping[str, Any],
                    kwargs: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """The request's tenant and engine salt (``tenancy.tenant_salt``, keyed with this deployment's secret)."""
        return tenancy.tenant_salt(gs, meta, kwargs, self.chain)

    def app_of(self, meta: Mapping[str, Any], kwargs: Mapping[str, Any],
             state: RequestState | None = None) -> str | None:
        """The app behind metrics and rules: the request's app (kept on ``state``; without one, the same rule read
        from ``meta``) as a label bounded per key (``tenancy.AppNames``)."""
        if self._apps is None:
            self._apps = tenancy.AppNames(self.settings.max_apps_per_key)
        app = state.app if state is not None else self.ids.app_rule(meta)
        return self._apps.label(app, meta.get("user_api_key_hash"))

    # --- the attempt -------------------------------------------------------------------------------
    async def async_pre_call_deployment_hook(self, kwargs: dict, call_type: Any) -> dict | None:
        try:
            return self.pre_call(kwargs)
        except Exception:
            log.debug("kvroute pre-call failed", exc_info=True)
            self.count_error("pre_call")
            return None

    def pre_call(self, kwargs: dict) -> dict | None:
        """The deployment really used (``pick.pre_call``): the changed upstream request, or None."""
        return pick.pre_call(self, kwargs)

    async def async_post_call_success_deployment_hook(self, request_data: dict, response: Any,
                                                      call_type: Any) -> Any:
        """A whole (non-streamed) answer is back, before LiteLLM returns it: release the pick's load now. The
        success event that reports it runs later as a background task in the SDK; a client sending its next
        request at once would otherwise see the replica that just answered as still busy."""
        if not request_data.get("stream"):
            self._answered(request_data)
        return None

    def _answered(self, kwargs: Mapping[str, Any]) -> None:
        try:
            ticket = self.ids.open_attempt(self.ids.resolve(request_metadata(kwargs)))
            if ticket is not None:
                self.events.answered(ticket)
        except Exception:
            self.count_error("answered")

    async def async_post_call_streaming_deployment_hook(self, request_data: dict, response_chunk: Any,
                                                        call_type: Any) -> Any:
        self._first_token(request_data)
        return None

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict) -> Any:
        """Proxy streams: mark the first token; if the client goes away mid-stream, book the attempt as
        ``cancelled`` with the output relayed so far and release the pick.

        On a client disconnect LiteLLM closes this iterator; its own late log of the partial stream finds the
        request booked, and the pick would otherwise hold its load until it expires.
        """
        done = False
        first = True
        usage_chunk = None
        relayed = 0  # chunks with output the client got: what a stream cut upstream still cost
        counts = chunk_has_output if self.billing is not None else None  # decided once, not per chunk
        source, race = response, None
        if self.hedges is not None:
            try:
                race = self.hedges.call(request_data)
            except Exception:
                self.count_error("hedge")
            if race is not None:
                source = hedged(response, race)
        try:
            async for item in source:
                if first:
                    first = False
                    self._first_token(request_data)
                if getattr(item, "usage", None) is not None:
                    usage_chunk = item
                if counts is not None and counts(item):
                    relayed += 1
                yield item
            done = True
            self._answered(request_data)  # the stream is over: the replica is done with it
            answered = race.answered if race is not None else response
            if self.billing is not None and usage_chunk is not None:  # before the proxy sends [DONE]
                try:
                    self.billing.pre_response(request_data, usage_chunk,
                                              hidden=getattr(answered, "_hidden_params", None), streamed=True)
                except Exception:
                    self.count_error("billing")
        except Exception:
            done = True  # an upstream error: the failure hooks report it
            if self.billing is not None and relayed:
                self.billing.stream_cut(request_data, relayed)
            raise
        finally:
            if race is not None:
                with contextlib.suppress(BaseException):
                    await source.aclose()  # a race the client left: close the hedge's stream now
            if not done:  # GeneratorExit / CancelledError: the client went away
                self._cancelled(request_data, relayed, usage_chunk)

    def _first_token(self, kwargs: Mapping[str, Any]) -> None:
        """A streamed chunk arrived: on the attempt's first, prefill is over (later chunks return before any check:
        the attempt their metadata names has already seen its first token, so there is nothing to do)."""
        try:
            meta = request_metadata(kwargs)
            named = meta.get(TICKET_KEY) if isinstance(meta, dict) else None
            seen = self.ids.attempt_of(named) if isinstance(named, str) else None
            if seen is not None and seen[1].first_token:
                return
            ticket = self.ids.open_attempt(self.ids.resolve(meta))
            if ticket is not None and not ticket.first_token:
                ticket.first_token = True
                self.events.first_token(ticket)
        except Exception:
            self.count_error("stream_chunk")

    def _cancelled(self, kwargs: Mapping[str, Any], relayed: int = 0, usage_chunk: Any = None) -> None:
        """The client went away: book what its provider bills for the attempt (``relayed`` output chunks, the
        provider's early usage if a chunk carried one), then release load (what was prefilled may stay cached);
        neutral for health."""
        try:
            found = self.ids.resolve(request_metadata(kwargs))
            ticket = self.ids.open_attempt(found)
            self.events.ended(Ended(How.CANCELLED, found, ticket, ticket.backend if ticket is not None else None,
                                    self.clock(), payload=Payload(kwargs, relayed=relayed,
                                                                  usage=getattr(usage_chunk, "usage", None))))
        except Exception:
            self.count_error("cancel")

    # --- outcomes ----------------------------------------------------------------------------------
    async def async_log_success_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            self.on_success(kwargs, response_obj, start_time, end_time)
        except Exception:
            log.debug("kvroute success hook failed", exc_info=True)
            self.count_error("success")

    def on_success(self, kwargs: Mapping[str, Any], response_obj: Any, start_time: Any, end_time: Any) -> None:
        found = self.ids.resolve(request_metadata(kwargs))
        ticket = self.ids.open_attempt(found)
        try:
            answer = outcomes.answer_of(kwargs, response_obj, start_time, end_time, ticket)
        except Exception:  # the ledger still books what the payload says (its own reader dead-letters the rest)
            self.count_error("success")
            answer = None
        self.events.ended(Ended(
            How.SUCCESS, found, ticket, deployment_id(kwargs) or (ticket.backend if ticket else None), self.clock(),
            answer=answer, payload=Payload(kwargs, response_obj, start_time, end_time)))

    async def async_post_call_success_hook(self, data: dict, user_api_key_dict: Any, response: Any) -> Any:
        """Proxy, before the response goes out: record the final success (a kill after the answer loses nothing)."""
        try:
            if self.billing is not None:
                self.billing.pre_response(data, response)
        except Exception:
            self.count_error("billing")
        return None

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> None:
        """Proxy, after LiteLLM's auth: the request is admitted to the ledger (never changes the request)."""
        try:
            if self.billing is not None:
                self.billing.admit(data)
        except Exception:
            self.count_error("billing")
        return None

    async def async_post_call_failure_hook(self, request_data: dict, original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> Any:
        """Proxy: the request failed for the client; record its final outcome (never changes the error)."""
        try:
            if self.billing is not None:
                verdict = outcomes.final_verdict(self.ids.state(request_metadata(request_data)), original_exception)
                self.billing.request_failed(request_data, original_exception, status=verdict.ledger_status)
        except Exception:
            self.count_error("billing")
        return None

    async def async_post_call_failure_deployment_hook(self, request_data: Mapping[str, Any], exception: Exception,
                                                      call_type: Any, fallback_depth: int | None = None) -> None:
        found = verdict = None
        try:
            found = self.ids.resolve(request_metadata(request_data))
            verdict = outcomes.attempt_verdict(request_data, exception, found)
        except Exception:
            self.count_error("attempt_failure")
        try:
            ticket = self.ids.open_attempt(found)
            self.events.ended(Ended(How.FAILED, found, ticket,
                                    deployment_id(request_data) or (ticket.backend if ticket else None), self.clock(),
                                    verdict, exception, payload=Payload(request_data, exception=exception)))
        except Exception:
            log.debug("kvroute failure hook failed", exc_info=True)
            self.count_error("attempt_failure")

    async def async_log_failure_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            exc = kwargs.get("exception")
            error = exc if isinstance(exc, BaseException) else RuntimeError(str(exc))
            found = self.ids.resolve(request_metadata(kwargs))
            verdict = outcomes.request_verdict(kwargs, error, found)
            if self.billing is not None:  # booked as the request's event
                self.billing.logged_failure(kwargs, exc, status=verdict.ledger_status
                                            if isinstance(exc, BaseException) else None)
            ending = outcomes.request_failure_ending(kwargs, error, found, verdict, self.clock())
            if ending is not None:
                self.events.ended(ending)
            if found is not None and error is exc:  # the request's later events read this verdict
                found[0].note_judged(error, verdict)
        except Exception:
            self.count_error("failure")

    async def log_success_fallback_event(self, original_model_group: str, kwargs: dict,
                                         original_exception: Exception) -> None:
        try:
            self.metrics.fallbacks.labels(str(original_model_group), "litellm_fallback").inc()
        except Exception:
            self.count_error("fallback")

    def count_error(self, hook: str) -> None:
        """Count an error a hook caught (never raises)."""
        with contextlib.suppress(Exception):
            self.metrics.error(hook)

    # --- introspection -----------------------------------------------------------------------------
    def worker_status(self) -> dict[str, Any]:
        """This worker's own counters (the shared state publishes them so any worker can answer for all)."""
        return status_view.worker_status(self)

    def status(self, show_api_base: bool = False) -> dict[str, Any]:
        """Breaker and routing state for ``kvroute status`` (``status_view.status``)."""
        return status_view.status(self, show_api_base)

    def shared_state_status(self, peers: Mapping[str, Any]) -> dict[str, Any]:
        """The Redis link and every live worker's replication lag (``status_view.shared_state_status``)."""
        return status_view.shared_state_status(self, peers)

    async def aclose(self) -> None:
        if self.billing is not None:
            try:
                self.billing.close()
            except Exception:
                self.count_error("billing_close")
        if self.parts.metrics is not None:
            self.parts.metrics.close()
        for group in self.precise.values():
            with contextlib.suppress(Exception):
                group.stop()
        for scraper in self.scrapers.values():
            with contextlib.suppress(Exception):
                scraper.stop()
        if self.parts.shared is not None:
            with contextlib.suppress(Exception):
                self.parts.shared.close()


_instance: KvrouteCallback | None = None
CONFIG_ERROR_EXIT = 2  # what every kvroute command exits with for a problem the user can fix


def get_callback() -> KvrouteCallback:
    """The process-wide callback named ``kvroute.plugin.kvroute_callback`` in configs."""
    global _instance
    if _instance is None:
        instance = KvrouteCallback()
        try:
            instance._setup()  # validate config (ConfigError names the key) and mount routes at startup
        except ConfigError as exc:
            print(f"kvroute: configuration error: {exc}", file=sys.stderr, flush=True)
            if "litellm.proxy.proxy_server" in sys.modules:  # the proxy's start-up: stop on that line, no
                os._exit(CONFIG_ERROR_EXIT)                   # server traceback under it (the SDK gets the raise)
            raise
        _instance = instance
    return _instance
