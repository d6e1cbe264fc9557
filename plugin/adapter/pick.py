"""The pick: narrow LiteLLM's healthy deployments to the policy's choice, then pin the attempt going upstream."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvroute.plugin.adapter import hybrid
from kvroute.plugin.adapter.attempt_events import Ended, How
from kvroute.plugin.adapter.hosted import forward_cache_key
from kvroute.plugin.adapter.request_ids import HEDGE_TO_KEY, Attempt
from kvroute.plugin.adapter.request_labels import request_tags
from kvroute.plugin.adapter.signals import deployment_id, request_metadata
from kvroute.plugin.adapter.tenancy import SALT_ENGINES, set_engine_salt
from kvroute.policies.attempts import RoutedAttempt

if TYPE_CHECKING:
    from kvroute.plugin.adapter.callback_host import CallbackHost


def pick(cb: CallbackHost, model: str, healthy: list, messages: Any, request_kwargs: dict | None,
         precise: Any = None) -> list:
    """The deployments LiteLLM may use for this attempt: the policy's pick, or ``healthy`` when kvroute is off.
    ``precise``: the (request, salt) a precise group's tokenizer already built."""
    s = cb.settings
    kwargs = request_kwargs if isinstance(request_kwargs, dict) else {}
    group = str(model)
    meta = request_metadata(kwargs, create=True)
    if meta is not None:  # every pick is an attempt (an empty one is a router-level hop), even unrouted
        close_previous(cb, meta, kwargs)
        state, attempt = cb.ids.new_attempt(meta, group, None)
        rid = attempt.ticket
    if not s.enabled or not healthy or meta is None:
        return healthy
    now = cb.clock()
    maybe_expire(cb, now)
    pairs = [(d, cb.fleet.backend(d)) for d in healthy]
    allowed = [(d, b) for d, b in pairs if cb.health.available(b.id, now)]
    hedge_to = meta.get(HEDGE_TO_KEY)
    if hedge_to is not None:  # a hedge of a late stream: only its route, or nothing
        allowed = [(d, b) for d, b in allowed if b.id == hedge_to]
        if not allowed:
            return []
    failed = state.failed
    if failed and allowed:  # a retry: avoid what already failed for this request while others remain
        untried = [(d, b) for d, b in allowed if b.id not in failed]
        allowed = untried or allowed
    if not allowed:
        if any(b.self_hosted for _, b in pairs):
            cb.metrics.fallbacks.labels(group, "all_open").inc()
            return []
        allowed = pairs  # hosted group with every breaker open: let LiteLLM try (Portkey-style bypass)
    backends = [b for _, b in allowed]
    router = cb.router_for(group, backends)
    app = cb.app_of(meta, kwargs, state)
    tags = request_tags(meta, s.tag_metadata_keys, kwargs.get("tags") if isinstance(kwargs.get("tags"), list)
                        else None)
    headers = meta.get("headers") if isinstance(meta.get("headers"), Mapping) else None
    if precise is not None:
        request, salt = precise
        request.request_id, request.app, request.tags = rid, app, tags
    else:
        tenant, salt = cb.tenant_salt(s.group(group), meta, kwargs)
        request = router.fingerprint(prompt_source(kwargs, messages), model=group, app=app, request_id=rid,
                                     tags=tags, headers=headers, tenant=tenant, salt=salt, client_salt=False)
    rule = cb.rules.resolve(group, app, tags) if len(cb.rules) else None
    policy = rule.policy if rule is not None else router.policy_for(group)
    if cb.attached.get(id(policy)) != len(backends):
        cb.attach(router, policy, backends)
        cb.attached[id(policy)] = len(backends)
    decision = router.pick(request, [b.id for b in backends], group=group, policy=policy)
    if cb.decision_log is not None:
        cb.decision_log.write(group, decision, kwargs.get("litellm_call_id"))
    cb.metrics.decision(group, decision.policy, decision.reason.split(":", 1)[0], decision.matched_tokens,
                        decision.wasted_prefill_tokens)
    if decision.why is not None:
        hybrid.observe_decision(cb.metrics, group, policy, decision, now)
    if decision.backend is None:
        if decision.reason.startswith("no_acceptable_provider"):
            cb.metrics.fallbacks.labels(group, "no_acceptable_provider").inc()
            return []
        return [d for d, _ in allowed]
    cache_key = None
    if request.session_key or request.keys:
        cache_key = f"kvr-{request.session_key or format(request.prefix_key(1024) or 0, 'x')}"
    pin(attempt, router, decision.backend, app, request.prompt_tokens, cache_key, now, request, policy, salt)
    cb.events.picked(attempt, now)
    chosen = [d for d, b in allowed if b.id == decision.backend]
    return chosen or [d for d, _ in allowed]


def pin(attempt: Attempt, router: Any, backend: str, app: str | None, prompt_tokens: int,
        cache_key: str | None, now: float, request: Any, policy: Any, salt: str | None) -> None:
    """Write the pick onto the attempt's record, which takes the router's record of it (a detached one holding
    ``request`` where the router kept none: its bookkeeping failed, and counted the error; the router holds it
    then, so that the attempt awaits its outcome like any other)."""
    routed = router.attempts.get(attempt.ticket)
    if routed is None or routed.request is not request:
        routed = RoutedAttempt(attempt.ticket, backend, now, charged=False, request=request)
        router.attempts.put(routed)
    attempt.router, attempt.backend, attempt.app, attempt.routed = router, backend, app, routed
    attempt.prompt_tokens, attempt.cache_key = prompt_tokens, cache_key
    attempt.started, attempt.policy, attempt.salt = now, policy, salt


def close_previous(cb: CallbackHost, meta: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    """A new pick for the same request (``request``: its data) means the previous attempt is over (retry or
    fallback)."""
    prev = cb.ids.ticket_of(meta)
    if not prev:
        return
    found = cb.ids.attempt_of(prev)
    if found is None or found[1].ended:  # its outcome came (a failure hook runs before LiteLLM's retry)
        return
    t = cb.ids.open_attempt(found)  # superseded: the policy hears it now; its late failure hook finds no attempt
    cb.events.ended(Ended(How.SUPERSEDED, found, t, t.backend if t is not None else None, cb.clock(),
                          request=request))


def maybe_expire(cb: CallbackHost, now: float) -> None:
    """Every ``expire_every_s``: expire the routers' old picks and the attempts that never got an outcome."""
    if now - cb.last_expire < cb.settings.expire_every_s:
        return
    cb.last_expire = now
    for router in cb.routers.values():
        router.expire()
    cb.ids.release_quiet()
    cb.metrics.set_inflight((b.id, cb.routers[b.group].load.inflight(b.id))
                            for b in cb.fleet.backends.values() if b.group in cb.routers)


def pre_call(cb: CallbackHost, kwargs: dict) -> dict | None:
    """The deployment really used for the attempt: move the pick there if LiteLLM chose another, and set the
    engine salt or the provider cache key on the upstream request (the changed ``kwargs``, or None)."""
    found = cb.ids.resolve(request_metadata(kwargs))
    backend_id = deployment_id(kwargs)
    ticket = cb.ids.open_attempt(found)
    if found is not None:  # the pick's load follows where LiteLLM sent it; the ledger notes the start
        found[1].started = cb.clock()
        cb.events.sent(found, backend_id, kwargs)
        found[1].backend = backend_id or found[1].backend
    if ticket is None or backend_id is None:
        return None
    backend = cb.fleet.backends.get(backend_id)
    if backend is None:
        return None
    if backend.self_hosted:
        return set_engine_salt(kwargs, ticket.salt if backend.engine in SALT_ENGINES else None)
    if not cb.settings.forward_cache_key or not ticket.cache_key:
        return set_engine_salt(kwargs, None)
    forwarded = forward_cache_key(kwargs, backend, ticket.cache_key)
    stripped = set_engine_salt(kwargs, None)
    return forwarded or stripped


def prompt_source(kwargs: Mapping[str, Any], messages: Any) -> Mapping[str, Any]:
    """What to fingerprint: the request's own messages or prompt, else the messages LiteLLM passed."""
    if kwargs.get("messages") is not None or kwargs.get("prompt") is not None:
        return kwargs
    return {**kwargs, "messages": messages}
