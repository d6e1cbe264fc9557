"""Prometheus metrics of the plugin (prometheus-client), with bounded per-app label cardinality.

Served on ``KVROUTE_METRICS_PORT`` (``serve``, 127.0.0.1 unless configured) and on ``/kvroute/metrics``; both
expose only ``kvroute_*`` families. With several proxy workers and ``PROMETHEUS_MULTIPROC_DIR`` set (before the
proxy starts), prometheus-client's multiprocess mode sums every worker's series, so any worker speaks for all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import Metric

OTHER = "other"
#: The app of a request whose key names none: the ledger's word for it (``kvroute.billing.litellm_events``).
UNATTRIBUTED = "unattributed"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BREAKER_STATES = ("closed", "half_open", "open")


class LabelLimiter:
    """Keeps the first ``limit`` distinct values; later ones collapse into ``other``."""

    def __init__(self, limit: int, missing: str = "unknown") -> None:
        self.limit = limit
        self.missing = missing
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        if not value:
            return self.missing
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return OTHER


PREFIX = "kvroute_"


class KvrouteOnly:
    """A collector that passes on only the ``kvroute_*`` families of another collector or registry."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name.startswith(PREFIX):
                yield family


class Metrics:
    """All kvroute series in one registry (pass a fresh one per test).

    ``multiproc_dir`` (prometheus-client's ``PROMETHEUS_MULTIPROC_DIR``) makes the exposition read every
    worker's files; ``shared_load`` says the in-flight gauge already counts every worker (Redis-shared load),
    so workers' values are not summed again.
    """

    def __init__(self, registry: CollectorRegistry | None = None, max_app_labels: int = 50,
                 multiproc_dir: Path | None = None, shared_load: bool = False) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.multiproc_dir = multiproc_dir
        self._exposed = CollectorRegistry(auto_describe=False)
        if multiproc_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self._exposed.register(KvrouteOnly(MultiProcessCollector(None, path=str(multiproc_dir))))
        else:
            self._exposed.register(KvrouteOnly(r))
        self.app_label = LabelLimiter(max_app_labels, missing=UNATTRIBUTED)
        self.backend_label = LabelLimiter(1024)
        self.decisions = Counter("kvroute_decisions_total", "Routing decisions", ["group", "policy", "reason"],
                                 registry=r)
        self.predicted_cached = Counter("kvroute_predicted_cached_tokens_total",
                                        "Prompt tokens the router predicted cached", ["group"], registry=r)
        self.wasted_prefill = Counter("kvroute_wasted_prefill_tokens_total",
                                      "Prompt tokens a pick sent to be prefilled on a replica while another "
                                      "replica held them (the index at decision time)", ["group"], registry=r)
        self.confirmed_cached = Counter("kvroute_confirmed_cached_tokens_total",
                                        "Prompt tokens the backend reported cached", ["group"], registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens_total", "Prompt tokens of completed requests",
                                     ["group"], registry=r)
        self.ttft = Histogram("kvroute_ttft_seconds", "Time to first token per backend", ["backend"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.inflight = Gauge("kvroute_inflight_requests", "Requests in flight per backend", ["backend"],
                              registry=r, multiprocess_mode="livemax" if shared_load else "livesum")
        self.outcomes = Counter("kvroute_attempts_total", "Upstream attempts by outcome", ["backend", "outcome"],
                                registry=r)
        self.breaker_state = Gauge("kvroute_breaker_state", "1 for the breaker's current state",
                                   ["backend", "state"], registry=r, multiprocess_mode="livemostrecent")
        self.breaker_transitions = Counter("kvroute_breaker_transitions_total", "Breaker state changes",
                                           ["backend", "to"], registry=r)
        self.fallbacks = Counter("kvroute_fallbacks_total", "Requests handed to LiteLLM fallbacks",
                                 ["group", "reason"], registry=r)
        self.hedges = Counter("kvroute_hedges_total", "Hedged streams: sent, won by the hedge, lost by either side",
                              ["group", "event"], registry=r)
        self.errors = Counter("kvroute_plugin_errors_total", "Internal plugin errors (request not affected)",
                              ["hook"], registry=r)
        self.app_requests = Counter("kvroute_app_requests_total", "Completed requests per app", ["app", "outcome"],
                                    registry=r)
        self.app_prompt_tokens = Counter("kvroute_app_prompt_tokens_total", "Prompt tokens per app", ["app"],
                                         registry=r)
        self.app_cached_tokens = Counter("kvroute_app_cached_tokens_total", "Cached prompt tokens per app",
                                         ["app"], registry=r)
        self.app_ttft = Histogram("kvroute_app_ttft_seconds", "Time to first token per app", ["app"],
                                  buckets=TTFT_BUCKETS, registry=r)
        self.hybrid_decisions = Counter("kvroute_hybrid_decisions_total", "Hybrid decisions by side and reason",
                                        ["group", "side", "reason"], registry=r)
        self.hybrid_share = Gauge("kvroute_hybrid_overflow_share", "Share of a hybrid group's recent decisions "
                                  "that went to hosted routes (the guard's window)", ["group"], registry=r,
                                  multiprocess_mode="livemostrecent")
        self.hybrid_mode = Gauge("kvroute_hybrid_overflow_mode", "1 while a hybrid group is in overflow mode",
                                 ["group"], registry=r, multiprocess_mode="livemostrecent")
        self.hybrid_spend = Gauge("kvroute_hybrid_hosted_spend_per_hour", "Hosted spend of a hybrid group over the "
                                  "guard's window, per hour", ["group", "currency"], registry=r,
                                  multiprocess_mode="livemostrecent")
        self.hybrid_local_share = Gauge("kvroute_hybrid_guard_local_share", "1 while a hybrid group's spend guard "
                                        "cannot reach the fleet's window and spends only this instance's share "
                                        "of the cap", ["group"], registry=r, multiprocess_mode="livemax")
        self.secret_mismatch = Gauge("kvroute_hash_secret_mismatch_workers", "Live workers keying their hashes "
                                     "with another hash_secret than this one (must be 0)", registry=r,
                                     multiprocess_mode="livemax")
        self.replication_lag = Gauge("kvroute_shared_state_replication_lag_seconds", "Age of the newest update "
                                     "from another worker when this worker applied it", registry=r,
                                     multiprocess_mode="livemax")
        self.predicted_ttft = Histogram("kvroute_predicted_ttft_seconds", "Predicted time to first token at the "
                                        "pick per backend (compare kvroute_ttft_seconds)", ["backend"],
                                        buckets=TTFT_BUCKETS, registry=r)
        self._server: tuple[object, threading.Thread] | None = None
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}

    # --- recorders (never raise: callers are on the request path) --------------------------------
    def _child(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: label values are bounded by the limiters, lookups are hot."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def decision(self, group: str, policy: str, reason: str, predicted_tokens: int,
                 wasted_prefill_tokens: int | None = None) -> None:
        self._child(self.decisions, group, policy, reason).inc()
        if predicted_tokens > 0:
            self._child(self.predicted_cached, group).inc(predicted_tokens)
        if wasted_prefill_tokens:
            self._child(self.wasted_prefill, group).inc(wasted_prefill_tokens)

    def completed(self, group: str, backend: str, app: str | None, prompt_tokens: int, cached_tokens: int | None,
                  ttft_s: float | None, app_tokens: tuple[int, int] | None = None) -> None:
        """A success; ``app_tokens``: (prompt, cache-read) tokens as the ledger counts them (its token buckets),
        else ``prompt_tokens``/``cached_tokens`` as the backend reported them. Money is the ledger's alone
        (``kvroute report``): no metric prices a request."""
        b = self.backend_label(backend)
        a = self.app_label(app)
        self._child(self.outcomes, b, "success").inc()
        self._child(self.prompt_tokens, group).inc(max(0, prompt_tokens))
        self._child(self.app_requests, a, "success").inc()
        app_prompt, app_cached = app_tokens if app_tokens is not None else (max(0, prompt_tokens), cached_tokens or 0)
        self._child(self.app_prompt_tokens, a).inc(app_prompt)
        if cached_tokens:
            self._child(self.confirmed_cached, group).inc(cached_tokens)
        if app_cached:
            self._child(self.app_cached_tokens, a).inc(app_cached)
        if ttft_s is not None and ttft_s >= 0:
            self._child(self.ttft, b).observe(ttft_s)
            self._child(self.app_ttft, a).observe(ttft_s)

    def hybrid_decision(self, group: str, backend: str | None, side: str, reason: str,
                        predicted_ttft_s: float | None) -> None:
        self._child(self.hybrid_decisions, group, side, reason).inc()
        if backend is not None and predicted_ttft_s is not None and predicted_ttft_s >= 0:
            self._child(self.predicted_ttft, self.backend_label(backend)).observe(predicted_ttft_s)

    def hybrid_state(self, group: str, share: float, overflowing: bool, spend_per_hour: Decimal,
                     currency: str) -> None:
        self._child(self.hybrid_share, group).set(share)
        self._child(self.hybrid_mode, group).set(1.0 if overflowing else 0.0)
        self._child(self.hybrid_spend, group, currency).set(float(spend_per_hour))

    def guard_scope(self, group: str, local_share: bool) -> None:
        self._child(self.hybrid_local_share, group).set(1.0 if local_share else 0.0)

    def shared_state(self, mismatched_workers: int, lag_s: float | None) -> None:
        self.secret_mismatch.set(mismatched_workers)
        if lag_s is not None:
            self.replication_lag.set(lag_s)

    def failed(self, backend: str, outcome: str, app: str | None = None) -> None:
        self._child(self.outcomes, self.backend_label(backend), outcome).inc()
        if app is not None:
            self._child(self.app_requests, self.app_label(app), outcome).inc()

    def set_inflight(self, counts: Iterable[tuple[str, int]]) -> None:
        for backend, n in counts:
            self._child(self.inflight, self.backend_label(backend)).set(n)

    def breaker(self, backend: str, state: str, previous: str | None) -> None:
        b = self.backend_label(backend)
        for s in BREAKER_STATES:
            self.breaker_state.labels(b, s).set(1.0 if s == state else 0.0)
        if previous is not None and previous != state:
            self.breaker_transitions.labels(b, state).inc()

    def error(self, hook: str) -> None:
        self.errors.labels(hook).inc()

    # --- exposition ------------------------------------------------------------------------------
    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of kvroute's own series (every worker's in multiprocess mode) and its type."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = any free port); returns the bound port. Idempotent."""
        if self._server is None:
            server, thread = start_http_server(port, addr=host, registry=self._exposed)
            self._server = (server, thread)
        server = self._server[0]
        return int(server.server_address[1])  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._server is not None:
            server = self._server[0]
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
