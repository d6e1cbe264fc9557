"""Hybrid groups in the proxy: tell the ``hybrid`` policy which deployments are hosted and what a self-hosted
token costs (the price book's per-token rate, the unit the ledger uses), and show its state.

A hybrid group is one LiteLLM model group that lists both kinds of deployment; kvroute picks among all of
them in ``async_filter_deployments`` (the one per-request choice LiteLLM 1.110.2 supports), so breakers,
attribution and billing see each backend as in any other group, and LiteLLM ``fallbacks`` stay the last resort.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from kvroute.plugin.deployments import Backend
from kvroute.plugin.metrics import Metrics
from kvroute.policies.decision import Decision
from kvroute.policies.hybrid import Hybrid, SelfHostedRate

log = logging.getLogger("kvroute.plugin")


def attach_fleet(policy: Any, backends: Sequence[Backend]) -> None:
    """Mark the group's hosted deployments and give each priced self-hosted replica its rate."""
    if not isinstance(policy, Hybrid):
        return
    policy.mark_hosted(b.id for b in backends if not b.self_hosted)
    for b in backends:
        if b.self_hosted and (b.input_price is not None or b.output_price is not None):
            policy.set_self_hosted_rate(b.id, SelfHostedRate(b.input_price or Decimal(0), b.output_price or Decimal(0),
                                                             b.currency))


def share_group_state(rule_policy: Any, group_policy: Any) -> None:
    """A rule's own hybrid policy (its own target) spends from the group's guard and learns in its marketplace."""
    if isinstance(rule_policy, Hybrid) and isinstance(group_policy, Hybrid) and rule_policy is not group_policy:
        rule_policy.guard = group_policy.guard
        rule_policy.market = group_policy.market


def observe_decision(metrics: Metrics, group: str, policy: Any, decision: Decision, now: float) -> None:
    """Metrics of one hybrid decision and its ``why`` in the debug log (ids, seconds and prices; no prompt text)."""
    if not isinstance(policy, Hybrid) or decision.why is None:
        return
    why = decision.why
    hosted = decision.backend is not None and policy.is_hosted(decision.backend)
    routes = why.get("routes") or {}
    predicted = (routes.get(decision.backend) or {}).get("ttft_s") if hosted else why.get("predicted_s")
    metrics.hybrid_decision(group, decision.backend, "hosted" if hosted else "self_hosted", decision.reason,
                            predicted if isinstance(predicted, int | float) else None)
    snap = policy.snapshot(now)
    metrics.hybrid_state(group, snap["overflow_share"], snap["mode"] == "overflow",
                         Decimal(snap["hosted_spend_per_hour"]), snap["currency"])
    if log.isEnabledFor(logging.DEBUG):
        log.debug("kvroute hybrid %s -> %s (%s) why=%s", group, decision.backend, decision.reason,
                  json.dumps(why, default=str, sort_keys=True))


def status_of(policy: Any, now: float) -> dict[str, Any]:
    """``{"hybrid": snapshot}`` for ``/kvroute/status`` ({} for other policies)."""
    if not isinstance(policy, Hybrid):
        return {}
    return {"hybrid": policy.snapshot(now)}
