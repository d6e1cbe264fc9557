"""``CallbackHost``: what the callback's delegates (``pick``, ``outcomes``, ``status_view``, ``wiring``) read and
write on ``KvrouteCallback``, stated as a Protocol so that they need not import the callback that calls them.
Every member is public: a delegate never reads the callback's private attributes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvroute.plugin.adapter.attempt_events import AttemptEvents
    from kvroute.plugin.adapter.billing_feed import BillingFeed
    from kvroute.plugin.adapter.decision_log import DecisionLog
    from kvroute.plugin.adapter.deployments import Backend, Deployments
    from kvroute.plugin.adapter.hedge import Hedges
    from kvroute.plugin.adapter.metrics import Metrics
    from kvroute.plugin.adapter.parts import Parts
    from kvroute.plugin.adapter.request_ids import RequestIds, RequestState
    from kvroute.plugin.adapter.rules import RuleBook
    from kvroute.plugin.adapter.signals import HealthAdapter
    from kvroute.plugin.settings import GroupSettings, KvrouteSettings
    from kvroute.policies import ChainKey, Router
    from kvroute.policies.base import Policy


class CallbackHost(Protocol):
    """The callback's state and the few methods its delegates call back; ``wiring`` fills the set-up fields once."""

    # set-up (``wiring.build``): ``parts`` as given to the constructor, completed on first use
    parts: Parts
    clock: Callable[[], float]
    chain: ChainKey | None
    chain_source: str
    chain_fingerprint: str
    billing: BillingFeed | None
    hedges: Hedges | None
    billing_target: tuple[str, Path, Path] | None
    recorder: Any
    decision_log: DecisionLog | None
    mounted: list[str]

    # per model group and per request
    ids: RequestIds
    routers: dict[str, Router]
    fleet: Deployments
    rules: RuleBook
    precise: dict[str, Any]
    scrapers: dict[str, Any]
    attached: dict[int, int]
    last_expire: float

    @property
    def settings(self) -> KvrouteSettings: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def health(self) -> HealthAdapter: ...

    @property
    def shared(self) -> Any: ...

    @property
    def events(self) -> AttemptEvents: ...

    def router_for(self, group: str, backends: Sequence[Backend]) -> Router: ...

    def attach(self, router: Router, policy: Policy, backends: Sequence[Backend]) -> None: ...

    def tenant_salt(self, gs: GroupSettings, meta: Mapping[str, Any],
                    kwargs: Mapping[str, Any]) -> tuple[str | None, str | None]: ...

    def app_of(self, meta: Mapping[str, Any], kwargs: Mapping[str, Any],
             state: RequestState | None = None) -> str | None: ...

    def count_error(self, hook: str) -> None: ...

    def worker_status(self) -> dict[str, Any]: ...
