"""Wiring: settings, metrics, health, billing, shared state and one ``Router`` per model group, built once."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvroute.billing.attribution import AppRule
from kvroute.plugin.adapter import hybrid, outcomes
from kvroute.plugin.adapter.attempt_events import AttemptEvents
from kvroute.plugin.adapter.billing_feed import BillingFeed, billing_target
from kvroute.plugin.adapter.decision_log import DecisionLog
from kvroute.plugin.adapter.hedge import Hedges
from kvroute.plugin.adapter.hosted import provider_quote
from kvroute.plugin.adapter.ledger_listener import Ledger
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.adapter.request_labels import LedgerLabels
from kvroute.plugin.adapter.rules import RuleBook
from kvroute.plugin.adapter.signals import HealthAdapter, breaker_config
from kvroute.plugin.adapter.startup_log import log_startup
from kvroute.plugin.settings import KvrouteSettings, load_settings, read_model_list
from kvroute.plugin.state.hash_secret import fingerprint, resolve_chain_key
from kvroute.policies import ChainKey, FingerprintConfig, PrefixIndexConfig, Router, RouterConfig
from kvroute.policies.base import Policy
from kvroute.policies.errors import ConfigError
from kvroute.policies.hedging import HedgeConfig
from kvroute.policies.lifecycle import FleetView, RouteSides
from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig
from kvroute.policies.registry import policy_names

if TYPE_CHECKING:
    from kvroute.plugin.adapter.callback_host import CallbackHost
    from kvroute.plugin.adapter.deployments import Backend
    from kvroute.plugin.adapter.parts import Parts

log = logging.getLogger("kvroute.plugin")


def build(cb: CallbackHost) -> None:
    """Load settings, metrics, the hash key, health, rules, billing and the proxy routes (once, at set-up)."""
    parts = cb.parts
    if parts.settings is None:
        parts.settings = load_settings(parts.proxy_config or proxy_config_path())
    s = parts.settings
    from kvroute.billing.location import check_data_dir

    check_data_dir(s.data_dir)  # a file there: one line naming kvroute.data_dir, before anything uses it
    if parts.metrics is None:
        from prometheus_client import REGISTRY

        parts.metrics = Metrics(REGISTRY, max_app_labels=s.max_app_labels,
                                multiproc_dir=s.prometheus_multiproc_dir, shared_load=bool(s.redis_url))
    if cb.chain is None:  # before Redis: instances sharing state must be given the secret
        cb.chain, cb.chain_source = resolve_chain_key(
            s.hash_secret.get_secret_value() if s.hash_secret else None, s.redis_url, s.data_dir,
            s.hash_secret_file)
        cb.chain_fingerprint = fingerprint(cb.chain) if s.redis_url else ""  # compared with other instances
    if parts.health is None:
        parts.health = HealthAdapter.build(parts.metrics, breaker_config(s.breaker),
                                           redis=connect_shared_state(parts))
    if parts.shared is not None and hasattr(parts.shared, "status_source"):
        parts.shared.status_source = cb.worker_status
        parts.shared.fingerprint = cb.chain_fingerprint
        parts.shared.on_heartbeat = lambda shared: cb.metrics.shared_state(
            len(shared.secret_mismatch), shared.replication()["lag_s"])
    cb.rules = RuleBook.from_settings(s.rules)
    if s.decision_log is not None and cb.decision_log is None:
        cb.decision_log = DecisionLog(s.decision_log)
    if s.metrics_port is not None:
        try:
            parts.metrics.serve(s.metrics_port, s.metrics_host)
        except OSError as exc:
            log.warning("kvroute: cannot serve metrics on port %s: %s", s.metrics_port, exc)
    in_proxy = "litellm.proxy.proxy_server" in sys.modules
    # one app rule for the ledger, metrics and rules: in the proxy a client's claim counts only where its key
    # trusts it; in the SDK the caller is the operator's own code
    cb.ids.app_rule = AppRule(tuple(s.app_metadata_keys), operator_calls=not in_proxy)
    cb.ids.labels = LedgerLabels(tuple(s.tag_metadata_keys))
    start_billing(cb, s, in_proxy=in_proxy)
    parts.events = attempt_events(cb)
    cb.ids.events = parts.events
    cb.hedges = build_hedges(cb, s)
    if parts.mount:
        mount_on_proxy(cb)
    learn_proxy_model_list(cb)
    log_startup(cb)


def attempt_events(cb: CallbackHost) -> AttemptEvents:
    """An attempt's events with their listeners, in call order: the ledger (while billing is on), routing (load,
    index, policy, breaker), the metrics, the request store, and the decision log (when one is kept)."""
    events = AttemptEvents(cb.count_error)
    events.subscribe(Ledger(lambda: cb.billing))
    events.subscribe(outcomes.Routing(cb))
    events.subscribe(outcomes.Counts(cb))
    events.subscribe(cb.ids)
    if cb.decision_log is not None:
        events.subscribe(cb.decision_log)
    return events


def learn_proxy_model_list(cb: CallbackHost) -> None:
    """Classify the proxy's ``model_list`` up front so status shows every backend before traffic."""
    path = cb.parts.proxy_config or proxy_config_path()
    if not path:
        return
    try:
        entries = read_model_list(path)
    except Exception:
        return
    names = {str(e.get("model_name")) for e in entries if isinstance(e, Mapping) and e.get("model_name")}
    for group in cb.settings.groups:
        if names and group not in names:
            raise ConfigError(f"kvroute.groups.{group}", f"no model group {group!r} in the proxy's model_list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not (entry.get("model_info") or {}).get("id"):
            continue  # LiteLLM assigns an id itself; the backend is learned on its first request
        try:
            cb.fleet.add_model_list([entry])
        except Exception as exc:  # e.g. os.environ/ references resolved only by LiteLLM
            log.warning("kvroute: model_list.%d not classified at startup: %s", i, exc)
    for group, backends in cb.fleet.groups().items():
        cb.router_for(group, backends)


def connect_shared_state(parts: Parts) -> Any:
    """Connect ``parts.shared`` to the Redis-shared state of ``redis_url`` (None when not configured or
    unreachable); returns it."""
    s = parts.settings
    if s is None or not s.redis_url:
        return None
    from kvroute.plugin.state import shared_state

    try:
        parts.shared = shared_state.connect(s.redis_url,
                                            shared_state.SharedStateConfig(namespace=s.redis_namespace))
    except Exception as exc:
        log.warning("kvroute: redis shared state unavailable (%s); routing on local state", exc)
        parts.shared = None
    return parts.shared


def build_hedges(cb: CallbackHost, s: KvrouteSettings) -> Hedges | None:
    """The groups' hedged streams (``groups.<name>.hedge``; None when no group hedges). A bad block raises
    ``ConfigError`` naming its key."""
    configs = {name: HedgeConfig.parse(g.hedge, f"kvroute.groups.{name}.hedge")
               for name, g in s.groups.items() if g.hedge is not None}
    if not configs:
        return None

    def expected_hit(backend: str) -> float:
        b = cb.fleet.backends.get(backend)
        router = cb.routers.get(b.group) if b is not None else None
        learned = getattr(router.policy_for(b.group), "expected_hit", None) if router is not None else None
        return float(learned(backend)) if callable(learned) else 0.0

    assert cb.parts.events is not None
    return Hedges(configs, fleet=cb.fleet, ids=cb.ids, available=lambda b: cb.health.available(b, cb.clock()),
                  billing=cb.billing, metrics=cb.metrics, events=cb.parts.events, expected_hit=expected_hit,
                  clock=cb.clock)


def start_billing(cb: CallbackHost, s: KvrouteSettings, *, in_proxy: bool) -> None:
    """On by default in the proxy (embedded SQLite in the data directory); see ``billing_feed.billing_target``."""
    cb.billing_target = billing_target(s, in_proxy=in_proxy)  # where it records (the startup line says)
    cb.billing = BillingFeed.start(s, cb.ids, in_proxy=in_proxy, on_error=cb.count_error)
    cb.recorder = cb.billing.recorder if cb.billing is not None else None
    if cb.billing is not None:
        cb.billing.kind_of = lambda backend: hybrid.route_kind(cb.fleet.backends.get(backend))
        cb.billing.provider_of = lambda backend: hybrid.provider_of(cb.fleet.backends.get(backend))
        cb.billing.served_of = lambda backend: hybrid.served_model(cb.fleet.backends.get(backend))
        from kvroute.plugin.adapter.billing_feed import RecorderCollector

        with contextlib.suppress(ValueError):  # already registered (a second callback on the registry)
            cb.metrics.registry.register(RecorderCollector(cb.billing))


def mount_on_proxy(cb: CallbackHost) -> None:
    """Add ``GET <status_path>`` and ``<status_path>/metrics`` to the running proxy app (if any)."""
    proxy = sys.modules.get("litellm.proxy.proxy_server")
    app = getattr(proxy, "app", None) if proxy else None
    if app is None:
        return
    try:
        from kvroute.plugin.cli.status import mount_routes

        cb.mounted = mount_routes(app, cb, cb.settings.status_path, auth=cb.settings.endpoint_auth)
    except Exception as exc:
        log.warning("kvroute: could not mount status routes: %s", exc)


def router_for(cb: CallbackHost, group: str, backends: Sequence[Backend]) -> Router:
    """One ``kvroute.policies.Router`` per model group, built on first use."""
    router = cb.routers.get(group)
    if router is not None:
        return router
    s = cb.settings
    gs = s.group(group)
    hosted = bool(backends) and not any(b.self_hosted for b in backends)
    block_tokens = s.block_bytes / 4.0
    engine_blocks = {b.block_size for b in backends}
    index_config = PrefixIndexConfig(capacity_tokens=s.kv_capacity_tokens, block_tokens=block_tokens,
                                      ttl_s=s.index_ttl_s if not hosted else (s.index_ttl_s or 600.0),
                                      engine_block_tokens=engine_blocks.pop() if len(engine_blocks) == 1 else None)
    index: Any = None
    load = None
    chain = cb.chain or ChainKey()
    llamacpp = bool(backends) and all(b.engine == "llamacpp" for b in backends)
    slots = max((b.slots or 1 for b in backends), default=1)
    if gs.mode == "precise":
        index = precise_index(index_config, chain, gs.precise, f"kvroute.groups.{group}.precise")
    elif llamacpp and cb.shared is None:  # llama.cpp keeps whole prompts, not blocks (policies/prompt_index.py)
        index = PromptIndex(PromptIndexConfig(cache_tokens=s.kv_capacity_tokens, slots=slots,
                                              block_tokens=block_tokens))
    elif cb.shared is not None:
        try:
            index = cb.shared.index(group, index_config)
            load = cb.shared.load(group)
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
    router = Router(config, clock=cb.clock, index=index, load=load, health=cb.health)
    router.tracing = cb.decision_log is not None
    if gs.mode == "precise" and index is not None:
        start_precise(cb, group, gs.precise, index, router)
    else:
        start_scraper(cb, group, backends, router)
    name, knobs = gs.policy_knobs
    if llamacpp and (name or s.default_policy) == "cache_aware" and "slots" not in knobs:
        knobs = {**knobs, "slots": slots}  # a llama.cpp request waits for a free slot (--parallel)
        name = name or "cache_aware"
    if name is not None:
        policy = router.set_policy(group, name, knobs)
    elif hosted and s.hosted_policy in policy_names():
        policy = router.set_policy(group, s.hosted_policy, {})
    else:
        policy = router.policy_for(group)
    attach(cb, router, policy, backends)
    for b in backends:
        if b.kv_capacity_tokens:
            router.set_capacity(b.id, b.kv_capacity_tokens)
    cb.routers[group] = router
    return router


def start_precise(cb: CallbackHost, group: str, block: Mapping[str, Any], index: Any, router: Router) -> None:
    """Start the precise group's KV-event feed and metrics scraper (approximate keys until it has a tokenizer)."""
    try:
        from kvroute.plugin.feeds.precise import group_from_config

        cb.precise[group] = group_from_config(group, block, index, router=router,
                                              where=f"kvroute.groups.{group}.precise").start()
    except ConfigError:
        raise  # a bad precise: block stops startup (settings validated its shape already)
    except Exception as exc:
        log.warning("kvroute: precise mode for %s unavailable: %s", group, exc)
        cb.count_error("precise_setup")


def start_scraper(cb: CallbackHost, group: str, backends: Sequence[Backend], router: Router) -> None:
    """Scrape the replicas' ``metrics_url``: queue depth and KV usage feed the load tracker (with their age),
    the engine's block count sets the approximate index's capacity, a restarted engine empties its part of the
    index. Unreachable pages leave router-side load."""
    known = {b.id: b for b in (*cb.fleet.backends.values(), *backends) if b.group == group}
    targets = {b.id: b.metrics_url for b in known.values() if b.self_hosted and b.metrics_url}
    if not targets:
        return
    try:
        from kvroute.plugin.feeds.engine_metrics import EngineMetricsScraper

        cb.scrapers[group] = EngineMetricsScraper(
            targets, router.observe, capacity_sink=router.capacity_heard, emptied_sink=router.engine_emptied,
            interval_s=cb.settings.metrics_scrape_interval_s, clock=cb.clock).start()
    except Exception as exc:
        log.warning("kvroute: engine metrics for %s unavailable: %s", group, exc)
        cb.count_error("metrics_setup")


def attach(cb: CallbackHost, router: Router, policy: Policy, backends: Sequence[Backend]) -> None:
    """Bind a policy to its group's fleet: the breakers, the priced backends' rate cards, which side each
    deployment is on (the ledger is read only when the policy asks) and, with shared state, the fleet's guard."""
    def sides() -> RouteSides:
        billing = cb.billing
        return hybrid.route_sides(backends, *(billing.price_view(b.id for b in backends) if billing else ({}, {})))

    shared, group = cb.shared, backends[0].group if backends else None
    share = (lambda p: hybrid.share_guard(p, shared, group)) if shared is not None and group is not None else None
    router.bind(policy, FleetView(
        health=cb.health.board, quotes=tuple(q for q in map(provider_quote, backends) if q is not None),
        sides=sides, share=share))


def precise_index(fallback: PrefixIndexConfig, chain: ChainKey, block: Mapping[str, Any], where: str) -> Any:
    """An event-fed index that answers from its approximate fallback for backends without events, crediting
    blocks by cache tier as the group's ``precise.tier_credit`` says."""
    from kvroute.plugin.feeds.precise import tier_credit_of
    from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig

    credit = tier_credit_of(block, where)
    return PreciseIndex(PreciseIndexConfig(fallback=fallback, chain=chain, tier_credit=credit))


def proxy_config_path() -> str | None:
    proxy = sys.modules.get("litellm.proxy.proxy_server")
    path = getattr(proxy, "user_config_file_path", None) if proxy else None
    return str(path) if path else None
