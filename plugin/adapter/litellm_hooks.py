"""The LiteLLM callback: pins each request to the policy's pick and feeds outcomes back (proxy and SDK alike).

Request flow (verified on LiteLLM 1.110.2): ``async_filter_deployments`` (pick; one call per attempt) →
``async_pre_call_deployment_hook`` (the deployment really used) → ``async_log_success_event`` or
``async_post_call_failure_deployment_hook`` (per attempt) + ``async_log_failure_event`` (request level).
Attempts are linked through a routing id written into the request's metadata dict (shared by every hook)
and, as a backup, LiteLLM's ``litellm_trace_id``. Every hook catches its own errors and counts them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvroute.plugin.adapter import hybrid
from kvroute.plugin.adapter.billing_feed import BillingFeed, billing_target, chunk_has_output
from kvroute.plugin.adapter.deployments import Backend, Deployments, litellm_cost_map
from kvroute.plugin.adapter.hosted import forward_cache_key, provider_quote
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.adapter.peer_filters import PeerFilters
from kvroute.plugin.adapter.request_ids import ATTEMPT_KEY, TICKET_KEY, RequestIds
from kvroute.plugin.adapter.rules import RuleBook, request_tags
from kvroute.plugin.adapter.signals import (
    HealthAdapter,
    breaker_config,
    cached_tokens_of,
    completion_tokens_of,
    deployment_id,
    duration_s,
    prompt_tokens_of,
    request_metadata,
    ttft_of,
)
from kvroute.plugin.adapter.startup_log import log_startup
from kvroute.plugin.settings import GroupSettings, KvrouteSettings, load_settings, read_model_list
from kvroute.plugin.state.hash_secret import fingerprint, resolve_chain_key
from kvroute.policies import ChainKey, FingerprintConfig, PrefixIndexConfig, Router, RouterConfig
from kvroute.policies.base import Policy
from kvroute.policies.errors import ConfigError
from kvroute.policies.lifecycle import CANCELLED, FAILURE, SUCCESS, FleetView, RequestOutcome, RouteSides
from kvroute.policies.outcomes import Attribution, FailureKind, classify
from kvroute.policies.registry import policy_names

log = logging.getLogger("kvroute.plugin")

RID_KEY = TICKET_KEY  # the ticket id of the current attempt (kvroute.plugin.adapter.request_ids)
__all__ = ["ATTEMPT_KEY", "RID_KEY", "KvrouteCallback", "get_callback"]
MAX_TICKETS = 100_000
MAX_REQUEST_STATES = 100_000  # requests whose attempts kvroute remembers (~0.3 KB each)
MAX_SEEN_FAILURES = 1024
SALT_ENGINES = frozenset({"vllm"})  # engines that take a per-request ``cache_salt`` into their prefix cache
KEY_SALT_FLAG = "kvroute_cache_salt"  # key metadata: this key may send its own cache_salt
KEY_APP = "kvroute_app"  # key metadata: the app a key belongs to (isolation: app)


@dataclass(slots=True)
class Ticket:
    """What the plugin remembers about one routed attempt until its outcome arrives."""

    rid: str
    group: str
    router: Router
    backend: str | None
    app: str | None
    predicted_tokens: int
    prompt_tokens: int
    cache_key: str | None
    started: float
    first_token: bool = False
    outcome: str | None = None
    request: Any = None
    policy: Any = None
    salt: str | None = None


class KvrouteCallback(CustomLogger):
    """KV-cache-aware routing, health filtering, metrics and billing hooks for LiteLLM (proxy and SDK)."""

    def __init__(self, settings: KvrouteSettings | None = None, *, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, proxy_config: str | None = None,
                 health: HealthAdapter | None = None, mount: bool = True) -> None:
        super().__init__()
        self._settings = settings
        self._proxy_config = proxy_config
        self._metrics = metrics
        self.clock = clock
        self._health = health
        self._mount = mount
        self._ready = False
        self.routers: dict[str, Router] = {}
        self.fleet = Deployments(litellm_cost_map, group_kind=self._group_kind)
        self.rules = RuleBook()
        self.tickets: OrderedDict[str, Ticket] = OrderedDict()
        self.ids = RequestIds(MAX_REQUEST_STATES)
        self.peer_filters = PeerFilters(self)  # LiteLLM's other filters (budgets...) narrow before the pick
        self.billing: BillingFeed | None = None
        self._apps_by_key: dict[str, set[str]] = {}
        self._failed: OrderedDict[str, list[str]] = OrderedDict()
        self._seen_failures: OrderedDict[int, BaseException] = OrderedDict()  # judged by the per-attempt hook
        self._attached: dict[int, int] = {}
        self.precise: dict[str, Any] = {}
        self.scrapers: dict[str, Any] = {}
        self._last_expire = clock()
        self.recorder: Any = None
        self.billing_target: tuple[str, Path, Path] | None = None
        self._shared: Any = None
        self.mounted: list[str] = []
        self.chain: ChainKey | None = None
        self.chain_source = ""
        self.chain_fingerprint = ""

    # --- lazy set-up (the proxy imports the module before its config and router exist) -----------
    @property
    def settings(self) -> KvrouteSettings:
        self._setup()
        assert self._settings is not None
        return self._settings

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._setup()
        assert self._metrics is not None
        return self._metrics

    @property
    def health(self) -> HealthAdapter:
        self._setup()
        assert self._health is not None
        return self._health

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
        if self._settings is None:
            self._settings = load_settings(self._proxy_config or _proxy_config_path())
        s = self._settings
        from kvroute.billing.location import check_data_dir

        check_data_dir(s.data_dir)  # a file there: one line naming kvroute.data_dir, before anything uses it
        if self._metrics is None:
            from prometheus_client import REGISTRY

            self._metrics = Metrics(REGISTRY, max_app_labels=s.max_app_labels,
                                    multiproc_dir=s.prometheus_multiproc_dir, shared_load=bool(s.redis_url))
        if self.chain is None:  # before Redis: instances sharing state must be given the secret
            self.chain, self.chain_source = resolve_chain_key(
                s.hash_secret.get_secret_value() if s.hash_secret else None, s.redis_url, s.data_dir,
                s.hash_secret_file)
            self.chain_fingerprint = fingerprint(self.chain) if s.redis_url else ""  # compared with other instances
        if self._health is None:
            self._health = HealthAdapter.build(self._metrics, breaker_config(s.breaker),
                                               redis=self._shared_state())
        if self._shared is not None and hasattr(self._shared, "status_source"):
            self._shared.status_source = self.worker_status
            self._shared.fingerprint = self.chain_fingerprint
            self._shared.on_heartbeat = lambda shared: self.metrics.shared_state(
                len(shared.secret_mismatch), shared.replication()["lag_s"])
        self.rules = RuleBook.from_settings(s.rules)
        if s.metrics_port is not None:
            try:
                self._metrics.serve(s.metrics_port, s.metrics_host)
            except OSError as exc:
                log.warning("kvroute: cannot serve metrics on port %s: %s", s.metrics_port, exc)
        self._start_billing(s)
        if self._mount:
            self._mount_on_proxy()
        self._learn_proxy_model_list()
        log_startup(self)

    def _learn_proxy_model_list(self) -> None:
        """Classify the proxy's ``model_list`` up front so status shows every backend before traffic."""
        path = self._proxy_config or _proxy_config_path()
        if not path:
            return
        try:
            entries = read_model_list(path)
        except Exception:
            return
        names = {str(e.get("model_name")) for e in entries if isinstance(e, Mapping) and e.get("model_name")}
        for group in self.settings.groups:
            if names and group not in names:
                raise ConfigError(f"kvroute.groups.{group}", f"no model group {group!r} in the proxy's model_list")
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping) or not (entry.get("model_info") or {}).get("id"):
                continue  # LiteLLM assigns an id itself; the backend is learned on its first request
            try:
                self.fleet.add_model_list([entry])
            except Exception as exc:  # e.g. os.environ/ references resolved only by LiteLLM
                log.warning("kvroute: model_list.%d not classified at startup: %s", i, exc)
        for group, backends in self.fleet.groups().items():
            self.router_for(group, backends)

    def _shared_state(self) -> Any:
        s = self._settings
        if s is None or not s.redis_url:
            return None
        try:
            from kvroute.plugin.state import shared_state  # written by the resilience engineer
        except ImportError:
            log.warning("kvroute: KVROUTE_REDIS_URL set but kvroute.plugin.state.shared_state is not available")
            return None
        try:
            self._shared = shared_state.connect(s.redis_url,
                                                shared_state.SharedStateConfig(namespace=s.redis_namespace))
        except Exception as exc:
            log.warning("kvroute: redis shared state unavailable (%s); routing on local state", exc)
            self._shared = None
        return self._shared

    def _start_billing(self, s: KvrouteSettings) -> None:
        """On by default in the proxy (embedded SQLite in the data directory); see ``billing_feed.billing_target``."""
        in_proxy = "litellm.proxy.proxy_server" in sys.modules
        self.billing_target = billing_target(s, in_proxy=in_proxy)  # where it records (the startup line says)
        self.billing = BillingFeed.start(s, self.ids, in_proxy=in_proxy, on_error=self._count_error)
        self.recorder = self.billing.recorder if self.billing is not None else None
        if self.billing is not None:
            self.billing.kind_of = lambda backend: hybrid.route_kind(self.fleet.backends.get(backend))
            self.billing.provider_of = lambda backend: hybrid.provider_of(self.fleet.backends.get(backend))
            self.billing.served_of = lambda backend: hybrid.served_model(self.fleet.backends.get(backend))
            from kvroute.plugin.adapter.billing_feed import RecorderCollector

            with contextlib.suppress(ValueError):  # already registered (a second callback on the registry)
                self.metrics.registry.register(RecorderCollector(self.billing))

    def _mount_on_proxy(self) -> None:
        """Add ``GET <status_path>`` and ``<status_path>/metrics`` to the running proxy app (if any)."""
        proxy = sys.modules.get("litellm.proxy.proxy_server")
        app = getattr(proxy, "app", None) if proxy else None
        if app is None:
            return
        try:
            from kvroute.plugin.cli.status import mount_routes

            self.mounted = mount_routes(app, self, self.settings.status_path, auth=self.settings.endpoint_auth)
        except Exception as exc:
            log.warning("kvroute: could not mount status routes: %s", exc)

    def _group_kind(self, group: str) -> str:
        s = self._settings
        return s.group(group).kind if s is not None else "auto"

    # --- routers -----------------------------------------------------------------------------------
    def router_for(self, group: str, backends: Sequence[Backend]) -> Router:
        """One ``kvroute.policies.Router`` per model group, built on first use."""
        router = self.routers.get(group)
        if router is not None:
            return router
        s = self.settings
        gs = s.group(group)
        hosted = bool(backends) and not any(b.self_hosted for b in backends)
        block_tokens = s.block_bytes / 4.0
        index_config = PrefixIndexConfig(capacity_tokens=s.kv_capacity_tokens, block_tokens=block_tokens,
                                          ttl_s=s.index_ttl_s if not hosted else (s.index_ttl_s or 600.0))
        index: Any = None
        load = None
        chain = self.chain or ChainKey()
        if gs.mode == "precise":
            index = _precise_index(index_config, chain, gs.precise, f"kvroute.groups.{group}.precise")
        elif self._shared is not None:
            try:
                index = self._shared.index(group, index_config)
                load = self._shared.load(group)
            except Exception as exc:
                log.warning("kvroute: shared state for %s unavailable: %s", group, exc)
                index, load = None, None
        config = RouterConfig(
            default_policy=s.default_policy,
            default_knobs=s.default_knobs,
            fingerprint=FingerprintConfig(block_bytes=s.block_bytes, chain=chain),
            index=index_config,
            max_request_age_s=s.max_request_age_s,
        )
        router = Router(config, clock=self.clock, index=index, load=load, health=self.health)
        if gs.mode == "precise" and index is not None:
            self._start_precise(group, gs.precise, index, router)
        else:
            self._start_scraper(group, backends, router)
        name, knobs = gs.policy_knobs
        if name is not None:
            policy = router.set_policy(group, name, knobs)
        elif hosted and s.hosted_policy in policy_names():
            policy = router.set_policy(group, s.hosted_policy, {})
        else:
            policy = router.policy_for(group)
        self._attach(router, policy, backends)
        for b in backends:
            if b.kv_capacity_tokens and hasattr(router.index, "set_capacity"):
                router.index.set_capacity(b.id, b.kv_capacity_tokens)  # type: ignore[attr-defined]
        self.routers[group] = router
        return router

    def _start_precise(self, group: str, block: Mapping[str, Any], index: Any, router: Router) -> None:
        """Start the precise group's KV-event feed and metrics scraper (approximate keys until it has a tokenizer)."""
        try:
            from kvroute.plugin.feeds.precise import group_from_config

            self.precise[group] = group_from_config(group, block, index, router=router,
                                                    where=f"kvroute.groups.{group}.precise").start()
        except ConfigError:
            raise  # a bad precise: block stops startup (settings validated its shape already)
        except Exception as exc:
            log.warning("kvroute: precise mode for %s unavailable: %s", group, exc)
            self._count_error("precise_setup")

    def _start_scraper(self, group: str, backends: Sequence[Backend], router: Router) -> None:
        """Scrape the replicas' ``metrics_url``: queue depth and KV usage feed the load tracker (with their age),
        the engine's block count sets the approximate index's capacity. Unreachable pages leave router-side load."""
        known = {b.id: b for b in (*self.fleet.backends.values(), *backends) if b.group == group}
        targets = {b.id: b.metrics_url for b in known.values() if b.self_hosted and b.metrics_url}
        if not targets:
            return
        try:
            from kvroute.plugin.feeds.engine_metrics import EngineMetricsScraper

            self.scrapers[group] = EngineMetricsScraper(
                targets, router.observe, capacity_sink=getattr(router.index, "set_capacity", None),
                interval_s=self.settings.metrics_scrape_interval_s, clock=self.clock).start()
        except Exception as exc:
            log.warning("kvroute: engine metrics for %s unavailable: %s", group, exc)
            self._count_error("metrics_setup")

    def _attach(self, router: Router, policy: Policy, backends: Sequence[Backend]) -> None:
        """Bind a policy to its group's fleet: the breakers, the priced backends' rate cards, which side each
        deployment is on (the ledger is read only when the policy asks) and, with shared state, the fleet's guard."""
        def sides() -> RouteSides:
            billing = self.billing
            return hybrid.route_sides(backends, *(billing.price_view(b.id for b in backends) if billing else ({}, {})))

        shared, group = self._shared, backends[0].group if backends else None
        share = (lambda p: hybrid.share_guard(p, shared, group)) if shared is not None and group is not None else None
        router.bind(policy, FleetView(
            health=self.health.board, quotes=tuple(q for q in map(provider_quote, backends) if q is not None),
            sides=sides, share=share))

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
                precise = await group.afingerprint(_prompt_source(kwargs, messages), model=str(model),
                                                   tenant=tenant, salt=salt)
            return self.filter(model, healthy_deployments, messages, request_kwargs, precise=precise)
        except Exception:
            log.debug("kvroute filter failed", exc_info=True)
            self._count_error("filter")
            return healthy_deployments

    def filter(self, model: str, healthy: list, messages: Any, request_kwargs: dict | None,
               precise: Any = None) -> list:
        """Synchronous core of ``async_filter_deployments`` (the SDK and the proxy share it)."""
        s = self.settings
        kwargs = request_kwargs if isinstance(request_kwargs, dict) else {}
        group = str(model)
        meta = request_metadata(kwargs, create=True)
        if meta is not None:  # every pick is an attempt (an empty one is a router-level hop), even unrouted
            self._close_previous(meta, kwargs)
            attempt, rid = self.ids.new_attempt(meta, group, None)
        if not s.enabled or not healthy or meta is None:
            return healthy
        now = self.clock()
        self._maybe_expire(now)
        pairs = [(d, self.fleet.backend(d)) for d in healthy]
        allowed = [(d, b) for d, b in pairs if self.health.available(b.id, now)]
        failed = self._failed.get(rid.rsplit(":", 1)[0])
        if failed and allowed:  # a retry: avoid what already failed for this request while others remain
            untried = [(d, b) for d, b in allowed if b.id not in failed]
            allowed = untried or allowed
        if not allowed:
            if any(b.self_hosted for _, b in pairs):
                self.metrics.fallbacks.labels(group, "all_open").inc()
                return []
            allowed = pairs  # hosted group with every breaker open: let LiteLLM try (Portkey-style bypass)
        backends = [b for _, b in allowed]
        router = self.router_for(group, backends)
        app = self._app(meta, kwargs)
        tags = request_tags(meta, s.tag_metadata_keys, kwargs.get("tags") if isinstance(kwargs.get("tags"), list)
                            else None)
        headers = meta.get("headers") if isinstance(meta.get("headers"), Mapping) else None
        tenant, salt = self.tenant_salt(s.group(group), meta, kwargs)
        if precise is not None:
            request = precise
            request.request_id, request.app, request.tags = rid, app, tags
        else:
            request = router.fingerprint(_prompt_source(kwargs, messages), model=group, app=app, request_id=rid,
                                         tags=tags, headers=headers, tenant=tenant, salt=salt, client_salt=False)
        rule = self.rules.resolve(group, app, tags) if len(self.rules) else None
        policy = rule.policy if rule is not None else router.policy_for(group)
        if self._attached.get(id(policy)) != len(backends):
            self._attach(router, policy, backends)
            self._attached[id(policy)] = len(backends)
        decision = router.pick(request, [b.id for b in backends], group=group, policy=policy)
        self.metrics.decision(group, decision.policy, decision.reason.split(":", 1)[0], decision.matched_tokens,
                              decision.wasted_prefill_tokens)
        if decision.why is not None:
            hybrid.observe_decision(self.metrics, group, policy, decision, now)
        if decision.backend is None:
            if decision.reason.startswith("no_acceptable_provider"):
                self.metrics.fallbacks.labels(group, "no_acceptable_provider").inc()
                return []
            return [d for d, _ in allowed]
        self.health.admit(decision.backend, now)
        attempt.backend = decision.backend
        cache_key = None
        if request.session_key or request.keys:
            cache_key = f"kvr-{request.session_key or format(request.prefix_key(1024) or 0, 'x')}"
        self._remember(Ticket(rid, group, router, decision.backend, app, decision.matched_tokens,
                              request.prompt_tokens, cache_key, now, request=request,
                              policy=policy, salt=salt))
        chosen = [d for d, b in allowed if b.id == decision.backend]
        return chosen or [d for d, _ in allowed]

    def tenant_salt(self, gs: GroupSettings, meta: Mapping[str, Any],
                    kwargs: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """The request's tenant under the group's ``isolation`` and the chain/engine salt, from the proxy's
        authenticated key data only (LiteLLM strips client-sent ``user_api_key_*`` metadata). A client's own
        ``cache_salt`` counts only when the key's metadata sets ``kvroute_cache_salt: true``; the salt sent to
        engines is a keyed digest, so one tenant cannot name another's."""
        key_meta = meta.get("user_api_key_metadata")
        key_meta = key_meta if isinstance(key_meta, Mapping) else {}
        parts: list[str] = []
        tenant = None
        if gs.isolation != "none":
            key = meta.get("user_api_key_hash")
            value = {"team": meta.get("user_api_key_team_id"), "key": key,
                     "app": key_meta.get(KEY_APP)}[gs.isolation]
            tenant = (f"{gs.isolation}:{value}" if value else f"key:{key}" if key else "anonymous")
            parts.append(tenant)
        if key_meta.get(KEY_SALT_FLAG) is True:
            client = _client_salt(kwargs)
            if client:
                parts.append("client:" + client)
        if not parts:
            return tenant, None
        return tenant, "kvr-" + (self.chain or ChainKey()).digest("\x00".join(parts))

    def _app(self, meta: Mapping[str, Any], kwargs: Mapping[str, Any]) -> str | None:
        """The app behind metrics and rules: billing's rule (``litellm_events.resolve_app``): from the key; a
        client's claim (``app_metadata_keys`` or ``kvroute_app``) only where the key allows it or there is no key
        (SDK). At most ``max_apps_per_key`` distinct apps per key; more are counted as ``other``."""
        from kvroute.billing.litellm_events import APP_KEY, resolve_app

        requester = meta.get("requester_metadata") if isinstance(meta.get("requester_metadata"), Mapping) else {}
        claim = None
        for src in (requester, meta):
            for key in (APP_KEY, *self.settings.app_metadata_keys):
                value = src.get(key)
                if isinstance(value, str) and value and claim is None:
                    claim = value
        view = dict(meta)
        if claim is not None:
            view["requester_metadata"] = {**requester, APP_KEY: claim}
            view.setdefault(APP_KEY, claim)
        app = resolve_app({}, view, trust_unauthenticated=True)
        if app is None:
            return None
        key = str(meta.get("user_api_key_hash") or "")
        seen = self._apps_by_key.setdefault(key, set())
        if app not in seen:
            if len(seen) >= self.settings.max_apps_per_key:
                return "other"
            seen.add(app)
        return app

    def _close_previous(self, meta: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
        """A new pick for the same request means the previous attempt is over (retry or fallback)."""
        prev = self.ids.ticket_of(meta)
        ticket = self.tickets.pop(prev, None) if prev else None
        if ticket is not None:  # superseded: the policy hears it now; its late failure hook finds no ticket
            ticket.router.finish(ticket.request, RequestOutcome(FAILURE, ticket.backend, self.clock()),
                                 policy=ticket.policy)
        if prev and self.billing is not None:
            self.billing.superseded(prev)

    def _remember(self, ticket: Ticket) -> None:
        self.tickets[ticket.rid] = ticket
        if len(self.tickets) > MAX_TICKETS:
            _, old = self.tickets.popitem(last=False)
            old.router.finish(old.request, RequestOutcome(CANCELLED, old.backend, self.clock()), policy=old.policy)

    def _ticket(self, kwargs: Mapping[str, Any], pop: bool = False) -> Ticket | None:
        """The open ticket of the attempt in ``kwargs`` (only a ticket id kvroute itself wrote is honoured)."""
        rid = self.ids.ticket_of(request_metadata(kwargs))
        if not rid:
            return None
        return self.tickets.pop(rid, None) if pop else self.tickets.get(rid)

    def _maybe_expire(self, now: float) -> None:
        if now - self._last_expire < self.settings.expire_every_s:
            return
        self._last_expire = now
        for router in self.routers.values():
            router.expire()
        horizon = now - self.settings.max_request_age_s
        while self.tickets:
            t = next(iter(self.tickets.values()))
            if t.started >= horizon:
                break
            self.tickets.popitem(last=False)
        self.metrics.set_inflight((b.id, self.routers[b.group].load.inflight(b.id))
                                  for b in self.fleet.backends.values() if b.group in self.routers)

    # --- the attempt -------------------------------------------------------------------------------
    async def async_pre_call_deployment_hook(self, kwargs: dict, call_type: Any) -> dict | None:
        try:
            return self.pre_call(kwargs)
        except Exception:
            log.debug("kvroute pre-call failed", exc_info=True)
            self._count_error("pre_call")
            return None

    def pre_call(self, kwargs: dict) -> dict | None:
        ticket = self._ticket(kwargs)
        backend_id = deployment_id(kwargs)
        found = self.ids.attempt_of(self.ids.ticket_of(request_metadata(kwargs)))
        if found is not None:
            attempt = found[1]
            attempt.backend = backend_id or attempt.backend
            if self.billing is not None:
                self.billing.attempt_started(attempt, kwargs)
        if ticket is None or backend_id is None:
            return None
        if backend_id != ticket.backend:
            ticket.router.on_attempt(ticket.rid, backend_id)
            ticket.backend = backend_id
        ticket.started = self.clock()
        backend = self.fleet.backends.get(backend_id)
        if backend is None:
            return None
        if backend.self_hosted:
            return _set_engine_salt(kwargs, ticket.salt if backend.engine in SALT_ENGINES else None)
        if not self.settings.forward_cache_key or not ticket.cache_key:
            return _set_engine_salt(kwargs, None)
        forwarded = forward_cache_key(kwargs, backend, ticket.cache_key)
        stripped = _set_engine_salt(kwargs, None)
        return forwarded or stripped

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
            ticket = self._ticket(kwargs)
            if ticket is not None:
                ticket.router.on_answered(ticket.rid)
        except Exception:
            self._count_error("answered")

    async def async_post_call_streaming_deployment_hook(self, request_data: dict, response_chunk: Any,
                                                        call_type: Any) -> Any:
        self._first_token(request_data)
        return None

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict) -> Any:
        """Proxy streams: mark the first token, and release the pick if the client goes away mid-stream.

        On a client disconnect LiteLLM closes this iterator and never logs the request, so the pick would
        otherwise hold its load until it expires.
        """
        done = False
        first = True
        usage_chunk = None
        relayed = 0  # chunks with output the client got: what a stream cut upstream still cost
        counts = chunk_has_output if self.billing is not None else None  # decided once, not per chunk
        try:
            async for item in response:
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
            if self.billing is not None and usage_chunk is not None:  # before the proxy sends [DONE]
                try:
                    self.billing.pre_response(request_data, usage_chunk,
                                              hidden=getattr(response, "_hidden_params", None), streamed=True)
                except Exception:
                    self._count_error("billing")
        except Exception:
            done = True  # an upstream error: the failure hooks report it
            if self.billing is not None and relayed:
                self.billing.stream_cut(request_data, relayed)
            raise
        finally:
            if not done:  # GeneratorExit / CancelledError: the client went away
                self._cancelled(request_data)

    def _first_token(self, kwargs: Mapping[str, Any]) -> None:
        try:
            ticket = self._ticket(kwargs)
            if ticket is not None and not ticket.first_token:
                ticket.first_token = True
                ticket.router.on_first_token(ticket.rid)
        except Exception:
            self._count_error("stream_chunk")

    def _cancelled(self, kwargs: Mapping[str, Any]) -> None:
        """The client went away: release load (what was prefilled may stay cached); neutral for health."""
        try:
            ticket = self._ticket(kwargs, pop=True)
            if ticket is None:
                return
            ticket.router.finish(ticket.request, RequestOutcome(CANCELLED, ticket.backend, self.clock(),
                                                                health="cancelled", started_at=ticket.started),
                                 policy=ticket.policy)
            if ticket.backend is not None:
                self.metrics.failed(ticket.backend, "cancelled", app=ticket.app)
        except Exception:
            self._count_error("cancel")

    # --- outcomes ----------------------------------------------------------------------------------
    async def async_log_success_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            self.on_success(kwargs, response_obj, start_time, end_time)
        except Exception:
            log.debug("kvroute success hook failed", exc_info=True)
            self._count_error("success")

    def on_success(self, kwargs: Mapping[str, Any], response_obj: Any, start_time: Any, end_time: Any) -> None:
        if self.billing is not None:
            self.billing.success(kwargs, response_obj, start_time, end_time,
                                 self.ids.ticket_of(request_metadata(kwargs)))
        ticket = self._ticket(kwargs, pop=True)
        slo = kwargs.get("standard_logging_object") if isinstance(kwargs.get("standard_logging_object"), Mapping) \
            else {}
        backend_id = deployment_id(kwargs) or (ticket.backend if ticket else None)
        cached = cached_tokens_of(response_obj)
        ttft = ttft_of(kwargs, slo, start_time, end_time)
        group = str(slo.get("model_group") or (ticket.group if ticket else "") or "")
        prompt_tokens = prompt_tokens_of(response_obj, slo)
        now = self.clock()
        if ticket is not None:
            # finish releases prefill and decode load and settles the blocks (no first-token step needed), then
            # the policy learns and the breaker hears the success
            ticket.outcome = "success"
            ticket.router.finish(ticket.request, RequestOutcome(
                SUCCESS, backend_id, now, cached_tokens=cached, ttft_s=ttft,
                output_tokens=completion_tokens_of(response_obj), duration_s=duration_s(start_time, end_time),
                prompt_tokens=prompt_tokens or None, health="success", started_at=ticket.started), policy=ticket.policy)
        elif backend_id is not None:  # not routed by kvroute: the breaker still hears it
            self.health.record(backend_id, "success", now, ttft_s=ttft)
        if backend_id is not None:
            cost = kwargs.get("response_cost", slo.get("response_cost"))
            app = ticket.app if ticket else self._app(request_metadata(kwargs) or {}, kwargs)
            self.metrics.completed(group, backend_id, app, prompt_tokens, cached, ttft,
                                   cost if isinstance(cost, int | float) else None)
            if ticket is not None:
                router = ticket.router
                self.metrics.set_inflight([(backend_id, router.load.inflight(backend_id))])

    async def async_post_call_success_hook(self, data: dict, user_api_key_dict: Any, response: Any) -> Any:
        """Proxy, before the response goes out: record the final success (a kill after the answer loses nothing)."""
        try:
            if self.billing is not None:
                self.billing.pre_response(data, response)
        except Exception:
            self._count_error("billing")
        return None

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> None:
        """Proxy, after LiteLLM's auth: the request is admitted to the ledger (never changes the request)."""
        try:
            if self.billing is not None:
                self.billing.admit(data)
        except Exception:
            self._count_error("billing")
        return None

    async def async_post_call_failure_hook(self, request_data: dict, original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> Any:
        """Proxy: the request failed for the client; record its final outcome (never changes the error)."""
        try:
            if self.billing is not None:
                self.billing.request_failed(request_data, original_exception)
        except Exception:
            self._count_error("billing")
        return None

    async def async_post_call_failure_deployment_hook(self, request_data: Mapping[str, Any], exception: Exception,
                                                      call_type: Any, fallback_depth: int | None = None) -> None:
        try:
            if self.billing is not None:
                self.billing.attempt_failed(request_data, exception,
                                            self.ids.ticket_of(request_metadata(request_data)))
        except Exception:
            self._count_error("billing")
        try:
            self.on_attempt_failure(request_data, exception)
        except Exception:
            log.debug("kvroute failure hook failed", exc_info=True)
            self._count_error("attempt_failure")

    def on_attempt_failure(self, request_data: Mapping[str, Any], exception: BaseException) -> Attribution:
        """One attempt failed: release its pick and feed the breaker what ``outcomes.classify`` blames."""
        self._remember_failure(exception)
        ticket = self._ticket(request_data, pop=True)
        backend_id = deployment_id(request_data) or (ticket.backend if ticket else None)
        verdict = classify(exception, backend_called=backend_id is not None,
                           first_token=bool(ticket and ticket.first_token))
        if ticket is not None:
            kind = CANCELLED if verdict.kind is FailureKind.CANCELLED else FAILURE
            ticket.router.finish(ticket.request, RequestOutcome(
                kind, backend_id, self.clock(), before_prefill=verdict.before_prefill,
                health=verdict.outcome.value if backend_id is not None else None,
                retry_after_s=verdict.retry_after_s, started_at=ticket.started), policy=ticket.policy)
        if backend_id is None:
            return verdict
        if ticket is not None and verdict.blames_backend:
            base = ticket.rid.rsplit(":", 1)[0]
            self._failed[base] = [*self._failed.get(base, ()), backend_id][-16:]
            self._failed.move_to_end(base)
            while len(self._failed) > 10_000:
                self._failed.popitem(last=False)
        if ticket is None:
            self._judge(backend_id, verdict, None)
        else:  # finish told the breaker
            self.metrics.failed(backend_id, verdict.outcome.value)
        return verdict

    def _judge(self, backend_id: str, verdict: Attribution, started: float | None) -> None:
        """Give the breaker and the metrics one attempt's verdict (a neutral one hands a half-open probe back)."""
        self.health.record(backend_id, verdict.outcome.value, self.clock(), status=verdict.status,
                           retry_after_s=verdict.retry_after_s, started_at=started)
        self.metrics.failed(backend_id, verdict.outcome.value)

    def _remember_failure(self, exception: BaseException) -> None:
        self._seen_failures[id(exception)] = exception  # held, so the id is not reused while remembered
        while len(self._seen_failures) > MAX_SEEN_FAILURES:
            self._seen_failures.popitem(last=False)

    def _already_judged(self, exception: BaseException) -> bool:
        link: BaseException | None = exception
        for _ in range(12):
            if link is None:
                return False
            if self._seen_failures.get(id(link)) is link:
                return True
            link = link.__cause__ or link.__context__
        return False

    async def async_log_failure_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        try:
            exc = kwargs.get("exception")
            if self.billing is not None:
                self.billing.logged_failure(kwargs, exc)
            self.on_request_failure(kwargs)
        except Exception:
            self._count_error("failure")

    def on_request_failure(self, kwargs: Mapping[str, Any]) -> Attribution | None:
        """LiteLLM's request-level failure event: judge it only when no per-attempt hook did (a bare SDK call,
        a cancellation). Its metadata may already name a newer attempt (a fallback's pick runs before this
        event), so only a verdict that blames a backend, or a cancellation, may touch that ticket."""
        exc = kwargs.get("exception")
        exc = exc if isinstance(exc, BaseException) else RuntimeError(str(exc))
        if self._already_judged(exc):
            return None
        ticket = self._ticket(kwargs)
        backend = deployment_id(kwargs)
        if ticket is not None and backend and ticket.backend != backend:
            # the metadata already names a newer attempt (a retry or a mid-stream continuation picked elsewhere):
            # judge the backend that failed, and leave the other attempt's ticket alone
            verdict = classify(exc, backend_called=True)
            if verdict.blames_backend:
                self._remember_failure(exc)
                self._judge(backend, verdict, None)
            return verdict
        verdict = classify(exc, backend_called=ticket is not None and ticket.backend is not None,
                           first_token=bool(ticket and ticket.first_token))
        if ticket is not None and (verdict.blames_backend or verdict.kind is FailureKind.CANCELLED):
            return self.on_attempt_failure(kwargs, exc)
        return verdict

    async def log_success_fallback_event(self, original_model_group: str, kwargs: dict,
                                         original_exception: Exception) -> None:
        try:
            self.metrics.fallbacks.labels(str(original_model_group), "litellm_fallback").inc()
        except Exception:
            self._count_error("fallback")

    def _count_error(self, hook: str) -> None:
        with contextlib.suppress(Exception):
            self.metrics.error(hook)

    # --- introspection -----------------------------------------------------------------------------
    def worker_status(self) -> dict[str, Any]:
        """This worker's own counters (the shared state publishes them so any worker can answer for all)."""
        return {"pending": len(self.tickets),
                "errors": {name: router.errors for name, router in list(self.routers.items())}}

    def status(self, show_api_base: bool = False) -> dict[str, Any]:
        """Breaker and routing state for ``kvroute status`` (ids, numbers and states only; ``api_base`` only
        when asked). Breakers, in-flight and index are shared through Redis; pending and errors are summed over
        the workers that published theirs within the last heartbeat TTL."""
        now = self.clock()
        backends = {}
        for b in self.fleet.backends.values():
            router = self.routers.get(b.group)
            backends[b.id] = {
                "group": b.group,
                "kind": b.kind,
                "provider": b.provider,
                "breaker": self.health.state(b.id, now),
                "inflight": router.load.inflight(b.id) if router else 0,
                "index_blocks": router.index.blocks(b.id) if router else 0,
            }
            if show_api_base:
                backends[b.id]["api_base"] = b.api_base
        mine = self.worker_status()
        peers = dict(getattr(self._shared, "peer_status", None) or {}) if self._shared is not None else {}
        pending = mine["pending"] + sum(int(p.get("pending", 0)) for p in peers.values())
        groups = {}
        for name, router in self.routers.items():
            errors = router.errors + sum(int((p.get("errors") or {}).get(name, 0)) for p in peers.values())
            groups[name] = {"policy": router.policy_for(name).name, "errors": errors,
                            **hybrid.status_of(router.policy_for(name), now)}
        out = {"groups": groups, "backends": backends, "rules": [r.name for r in self.rules.rules],
               "pending": pending, "workers": 1 + len(peers),
               "hash_key": {"keyed": bool(self.chain and self.chain.keyed), "source": self.chain_source}}
        if self._shared is not None:
            out["hash_key"]["fingerprint"] = self.chain_fingerprint
            mismatch = list(getattr(self._shared, "secret_mismatch", []))
            out["hash_key"]["disagreeing_workers"] = mismatch
            if mismatch:
                out["hash_key"]["warning"] = (f"{len(mismatch)} live worker(s) use another hash_secret: their "
                                              "prefixes never match here; give every instance the same secret")
            out["shared_state"] = self.shared_state_status(peers)
        return out

    def shared_state_status(self, peers: Mapping[str, Any]) -> dict[str, Any]:
        """The Redis link (stream entries applied, re-seeds after an emptied Redis, errors) and every live worker's
        replication lag (seconds), this one first; ``replication`` is this worker's, with recent percentiles."""
        shared = self._shared
        mine = shared.replication() if hasattr(shared, "replication") else {}
        workers = {shared.worker_id: {**mine, "fingerprint": self.chain_fingerprint, "self": True}}
        for w, p in sorted(peers.items()):
            workers[w] = {**(p.get("replication") or {}), "fingerprint": p.get("fp")}
        with contextlib.suppress(Exception):
            self.metrics.shared_state(len(getattr(shared, "secret_mismatch", [])), mine.get("lag_s"))
        stats = shared.stats() if hasattr(shared, "stats") else {}
        return {"connected": bool(getattr(shared, "connected", False)), "namespace": shared.config.namespace,
                "instances": len(workers), "workers": workers, "replication": mine,
                **{k: stats[k] for k in ("entries", "applied", "reseeds", "errors") if k in stats}}

    async def aclose(self) -> None:
        if self.billing is not None:
            try:
                self.billing.close()
            except Exception:
                self._count_error("billing_close")
        if self._metrics is not None:
            self._metrics.close()
        for group in self.precise.values():
            with contextlib.suppress(Exception):
                group.stop()
        for scraper in self.scrapers.values():
            with contextlib.suppress(Exception):
                scraper.stop()
        if self._shared is not None:
            with contextlib.suppress(Exception):
                self._shared.close()


def _precise_index(fallback: PrefixIndexConfig, chain: ChainKey, block: Mapping[str, Any], where: str) -> Any:
    """An event-fed index that answers from its approximate fallback for backends without events, crediting
    blocks by cache tier as the group's ``precise.tier_credit`` says."""
    from kvroute.plugin.feeds.precise import tier_credit_of
    from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig

    credit = tier_credit_of(block, where)
    return PreciseIndex(PreciseIndexConfig(fallback=fallback, chain=chain, tier_credit=credit))


def _client_salt(kwargs: Mapping[str, Any]) -> str | None:
    """The ``cache_salt`` a client sent (top level or ``extra_body``), if any."""
    extra = kwargs.get("extra_body")
    value = kwargs.get("cache_salt") or (extra.get("cache_salt") if isinstance(extra, Mapping) else None)
    return str(value) if isinstance(value, str | int) and value != "" else None


def _set_engine_salt(kwargs: dict, salt: str | None) -> dict | None:
    """Make the upstream request carry exactly ``salt`` as ``cache_salt`` (none when None): a client's own
    value never reaches an engine unchanged. Returns ``kwargs`` when it changed, else None."""
    extra = kwargs.get("extra_body")
    had = "cache_salt" in kwargs or (isinstance(extra, Mapping) and "cache_salt" in extra)
    if not had and salt is None:
        return None
    kwargs.pop("cache_salt", None)
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    extra.pop("cache_salt", None)
    if salt is not None:
        extra["cache_salt"] = salt
    if extra:
        kwargs["extra_body"] = extra
    else:
        kwargs.pop("extra_body", None)
    return kwargs


def _prompt_source(kwargs: Mapping[str, Any], messages: Any) -> Mapping[str, Any]:
    if kwargs.get("messages") is not None or kwargs.get("prompt") is not None:
        return kwargs
    return {**kwargs, "messages": messages}


def _proxy_config_path() -> str | None:
    proxy = sys.modules.get("litellm.proxy.proxy_server")
    path = getattr(proxy, "user_config_file_path", None) if proxy else None
    return str(path) if path else None


_instance: KvrouteCallback | None = None


def get_callback() -> KvrouteCallback:
    """The process-wide callback named ``kvroute.plugin.kvroute_callback`` in configs."""
    global _instance
    if _instance is None:
        instance = KvrouteCallback()
        try:
            instance._setup()  # validate config (ConfigError names the key) and mount routes at startup
        except ConfigError as exc:
            print(f"kvroute: configuration error: {exc}", file=sys.stderr, flush=True)
            raise
        _instance = instance
    return _instance
