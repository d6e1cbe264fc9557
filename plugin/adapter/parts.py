"""``Parts``: the services one callback runs on (settings, metrics, health, shared state, the attempts' events),
built once by ``wiring``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.plugin.adapter.attempt_events import AttemptEvents
    from kvroute.plugin.adapter.metrics import Metrics
    from kvroute.plugin.adapter.signals import HealthAdapter
    from kvroute.plugin.settings import KvrouteSettings


@dataclass(slots=True)
class Parts:
    """What the constructor was given, completed by ``wiring.build`` (a part left None there is built on set-up)."""

    settings: KvrouteSettings | None = None
    proxy_config: str | None = None  # the proxy's config file (None: the running proxy's own, if any)
    metrics: Metrics | None = None
    health: HealthAdapter | None = None
    mount: bool = True  # mount the status routes on a running proxy
    shared: Any = None  # the Redis-shared state (None: not configured or unreachable; state local to this worker)
    events: AttemptEvents | None = None  # an attempt's events and their listeners (ledger, routing, metrics)
