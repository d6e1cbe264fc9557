"""Hybrid groups in the proxy: which deployments are hosted and what a self-hosted token costs (``route_sides``,
which the ``hybrid`` policy reads through ``FleetView.sides``: the ledger's rate card for the replica when the
price file has one, else its ``model_list`` per-token price, the same precedence the ledger rates with), the
fleet's shared guard, and the policy's state in metrics and status.

A hybrid group is one LiteLLM model group that lists both kinds of deployment; kvroute picks among all of
them in ``async_filter_deployments`` (the one per-request choice LiteLLM 1.110.2 supports), so breakers,
attribution and billing see each backend as in any other group, and LiteLLM ``fallbacks`` stay the last resort.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from kvroute.plugin.adapter.deployments import Backend
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.policies.base import Policy
from kvroute.policies.decision import Decision
from kvroute.policies.hybrid import Hybrid
from kvroute.policies.lifecycle import RouteSides
from kvroute.policies.rates import SelfHostedRate

log = logging.getLogger("kvroute.plugin")


def route_sides(backends: Sequence[Backend], cards: Mapping[str, Any] | None = None,
                declared: Mapping[str, Any] | None = None) -> RouteSides:
    """The group's hosted deployments and each self-hosted replica's rate: its rate card from the ledger's catalog
    (``cards``: backend id -> ``CostRate``, e.g. a GPU-hour card) when it has one, else its ``model_list`` price
    (the ledger's fallback too, as LiteLLM's cost). Which side a deployment is on is the price file's
    ``route_kind`` when it declares the backend (``declared``: id -> ``BackendIdentity``), else the deployment's:
    the answer the ledger rates its events with."""
    own = {b.id for b in backends if route_kind(b, (declared or {}).get(b.id)) == "self_hosted"}
    rates = {b.id: rate for b in backends if b.id in own
             and (rate := self_hosted_rate(b, (cards or {}).get(b.id))) is not None}
    return RouteSides(frozenset(b.id for b in backends if b.id not in own), rates)


def self_hosted_rate(backend: Backend, card: Any = None) -> SelfHostedRate | None:
    """The replica's cost per token: ``card.per_token()`` (a ``CostRate``) when given, else the ``model_list``
    price, else None (unpriced)."""
    if card is not None:
        input_price, output_price = card.per_token()
        return SelfHostedRate(input_price, output_price, card.currency)
    if backend.input_price is None and backend.output_price is None:
        return None
    return SelfHostedRate(backend.input_price or Decimal(0), backend.output_price or Decimal(0), backend.currency)


def route_kind(backend: Backend | None, declared: Any = None) -> str | None:
    """The ledger's route kind of a deployment: the price file's (``declared``, a ``BackendIdentity``) when it names
    the backend, else ``self_hosted`` for a replica, ``marketplace`` for a marketplace provider, ``direct`` for any
    other hosted one (None: not a deployment kvroute knows)."""
    if declared is not None:
        return str(declared.route_kind)
    if backend is None:
        return None
    if backend.self_hosted:
        return "self_hosted"
    return "marketplace" if backend.provider == "marketplace" else "direct"


def provider_of(backend: Backend | None) -> str | None:
    """The deployment's provider as the ledger books it (the same for streamed and non-streamed attempts)."""
    return backend.provider if backend is not None else None


def served_model(backend: Backend | None) -> str | None:
    """The model the deployment serves as LiteLLM's logging names it (``openai/fake-model`` -> ``fake-model``), the
    same for successful, streamed and failed attempts."""
    if backend is None or not backend.model:
        return None
    return backend.model.split("/", 1)[1] if "/" in backend.model else backend.model


def share_guard(policy: Hybrid, shared: Any, group: str) -> None:
    """Give a hybrid group's guard the fleet's spend window, share and overflow clock, and its marketplace the
    fleet's hosted TTFT samples (``plugin.fleet_guard``) when instances share state; once per guard. The hybrid
    policy calls it from ``bind`` (``FleetView.share``)."""
    if shared is None or policy.guard.fleet is not None:
        return
    from kvroute.plugin.state.fleet_guard import FleetTtft, RedisSpend

    guard = policy.guard
    fleet = RedisSpend(shared, group, window_s=guard.spend_window_s, reservation_ttl_s=guard.reservation_ttl_s)
    fleet.guard = guard
    guard.fleet = fleet
    guard.scope = "fleet"
    FleetTtft(shared, group, policy)


def observe_decision(metrics: Metrics, group: str, policy: Policy, decision: Decision, now: float) -> None:
    """Metrics of one hybrid decision and its ``why`` in the debug log (ids, seconds and prices; no prompt text).
    A hybrid decision is one with a ``why`` from a policy whose snapshot shows an overflow share."""
    if decision.why is None:
        return
    snap = policy.snapshot(now)
    if "overflow_share" not in snap:
        return
    why = decision.why
    hosted = decision.backend is not None and "hosted_price" in why  # only a hosted pick prices its route
    routes = why.get("routes") or {}
    predicted = (routes.get(decision.backend) or {}).get("ttft_s") if hosted else why.get("predicted_s")
    metrics.hybrid_decision(group, decision.backend, "hosted" if hosted else "self_hosted", decision.reason,
                            predicted if isinstance(predicted, int | float) else None)
    metrics.hybrid_state(group, snap["overflow_share"], snap["mode"] == "overflow",
                         Decimal(snap["hosted_spend_per_hour"]), snap["currency"])
    metrics.guard_scope(group, snap["guard_scope"] == "local_share")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("kvroute hybrid %s -> %s (%s) why=%s", group, decision.backend, decision.reason,
                  json.dumps(why, default=str, sort_keys=True))


def status_of(policy: Policy, now: float) -> dict[str, Any]:
    """``{policy name: snapshot}`` for ``/kvroute/status`` ({} for a policy with nothing to show)."""
    snap = policy.snapshot(now)
    return {policy.name: snap} if snap else {}
