"""What a policy hears besides a request: its fleet (``FleetView``, given to ``bind``) and how each routed
attempt ended (``RequestOutcome``, given to ``observe`` by ``Router.finish``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvroute.policies.health import HealthBoard
    from kvroute.policies.rates import ProviderQuote, SelfHostedRate

SUCCESS, FAILURE, CANCELLED = "success", "failure", "cancelled"


@dataclass(frozen=True, slots=True)
class RouteSides:
    """Which backends are hosted routes and what a self-hosted replica's token costs (unpriced: absent)."""

    hosted: frozenset[str] = frozenset()
    self_hosted_rates: Mapping[str, SelfHostedRate] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet as a policy may know it; every field optional, a policy reads what it needs and ignores the rest.

    ``sides`` is called only by a policy that prices both sides (it may read a ledger); ``share`` is called by
    a policy with state worth sharing between proxy instances; ``group_state`` is one dict per model group,
    handed to the group's policy and to its rules' policies so they can keep one state; ``replicas`` and
    ``preset`` are the simulated engines (simulator-only references)."""

    health: HealthBoard | None = None
    quotes: tuple[ProviderQuote, ...] = ()
    sides: Callable[[], RouteSides] | None = None
    share: Callable[[Any], None] | None = None
    group_state: dict[str, Any] | None = None
    replicas: Mapping[str, Any] = field(default_factory=dict)
    preset: Any = None


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How one routed attempt ended: ``kind`` is ``success``, ``failure`` or ``cancelled``; ``at`` is router time.

    ``health`` is the breaker's outcome word for ``backend`` (None: the breaker hears nothing);
    ``before_prefill``: a failure's new blocks were never computed and leave the index."""

    kind: str
    backend: str | None
    at: float
    cached_tokens: int | None = None
    ttft_s: float | None = None
    output_tokens: int | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    before_prefill: bool = True
    health: str | None = None
    retry_after_s: float | None = None
    started_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.kind == SUCCESS


class HealthSink(Protocol):
    """Where ``Router.finish`` reports an attempt's outcome for the backend's breaker (``HealthBoard`` fits)."""

    def record(self, backend: str, outcome: Any, now: float, *, retry_after_s: float | None = None,
               ttft_s: float | None = None, started_at: float | None = None) -> Any: ...
