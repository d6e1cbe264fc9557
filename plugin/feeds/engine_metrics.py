"""Engine metrics scraper: vLLM / SGLang / llama.cpp ``/metrics`` → ``ExternalSignal`` with its age.

``parse_metrics(text)`` reads the Prometheus text format into an ``EngineSnapshot`` (queue depth, running
requests, KV usage, prefix-cache counters, block size and block count). ``EngineMetricsScraper`` polls
each backend on an interval in a background thread and hands signals to a sink (``Router.observe``) and
KV capacity in tokens (``num_gpu_blocks × block_size``) to a capacity sink (``index.set_capacity``). A prompt-token
counter that went back (the engine restarted, its cache empty) goes to an emptied sink (``Router.engine_emptied``)
with the time of the last reading of the old engine.
Unreachable or malformed metrics produce no signal: the router keeps using its own load accounting.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvroute.plugin.feeds import precise_metrics as pm
from kvroute.policies.load import ExternalSignal

log = logging.getLogger(__name__)

# metric name -> snapshot field; the first family present wins (labels summed over engines/ranks).
_GAUGES: dict[str, tuple[str, ...]] = {
    "queue_depth": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                 "llamacpp:kv_cache_usage_ratio"),
    "cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "llamacpp:prompt_tokens_cached"),
    "cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries", "llamacpp:prompt_tokens"),
}
_AVERAGED = {"kv_usage"}
_CACHE_INFO = ("vllm:cache_config_info", "sglang:cache_config_info")


@dataclass(slots=True)
class EngineSnapshot:
    """What one scrape said; fields the engine does not export stay None."""

    engine: str | None = None
    queue_depth: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    cache_hits: float | None = None
    cache_queries: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    read_at: float | None = None  # the scraper's clock when it was read

    @property
    def capacity_tokens(self) -> int | None:
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(float(labels[name]))
    except (KeyError, ValueError, TypeError):
        return None
    return value if value > 0 else None


_WANTED = tuple(sorted({n for names in _GAUGES.values() for n in names} | set(_CACHE_INFO)))


def _wanted_lines(text: str) -> str:
    """Only the samples (and their ``# TYPE``/``# HELP`` lines) of the metrics read here: a vLLM page is mostly
    histograms, and the Prometheus parser is ~10× slower on all of it than on this subset."""
    return "\n".join(line for line in text.splitlines()
                      if line.startswith(_WANTED) or (line.startswith(("# TYPE ", "# HELP "))
                                                      and line[7:].startswith(_WANTED))) + "\n"


def parse_metrics(text: str) -> EngineSnapshot:
    """Parse Prometheus text exposition; raises ``ValueError`` when it is not that format."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    snap = EngineSnapshot()
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            name = sample.name
            base = name[:-6] if name.endswith("_total") else name
            if family.name in _CACHE_INFO or base in _CACHE_INFO:
                snap.block_size = snap.block_size or _int_label(sample.labels, "block_size") or _int_label(
                    sample.labels, "page_size")
                snap.num_gpu_blocks = snap.num_gpu_blocks or _int_label(sample.labels, "num_gpu_blocks")
                continue
            if name.endswith("_created"):
                continue
            found.setdefault(base, []).append(float(sample.value))
    for field_name, names in _GAUGES.items():
        for metric in names:
            values = found.get(metric)
            if values:
                total = sum(values)
                setattr(snap, field_name, total / len(values) if field_name in _AVERAGED else total)
                if snap.engine is None:
                    snap.engine = metric.split(":", 1)[0]
                break
    return snap


def hit_rate(before: EngineSnapshot, after: EngineSnapshot) -> float | None:
    """Prefix-cache hit rate (in tokens) between two scrapes: Δhits / Δqueries."""
    if None in (before.cache_hits, before.cache_queries, after.cache_hits, after.cache_queries):
        return None
    dq = after.cache_queries - before.cache_queries  # type: ignore[operator]
    if dq <= 0:
        return None
    return max(0.0, (after.cache_hits - before.cache_hits) / dq)  # type: ignore[operator]


def restarted(before: EngineSnapshot | None, after: EngineSnapshot) -> bool:
    """Whether the engine restarted between two scrapes: its prompt-token (prefix-query) counter, which only grows
    while the process lives, went back."""
    if before is None or before.cache_queries is None or after.cache_queries is None:
        return False
    return after.cache_queries < before.cache_queries


class _KeepAliveGet:
    """``GET url`` → body text over one kept-alive stdlib connection per host (a quarter of httpx's CPU per
    scrape, and the scraper shares the proxy's GIL); a non-200 answer raises ``OSError``. Proxy variables
    are not applied: replicas are scraped directly."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def get(self, url: str) -> str:
        parts = urlsplit(url)
        key = (parts.scheme, parts.netloc)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (0, 1):  # a kept-alive connection the server has closed fails once, then reconnects
            conn = self._conns.get(key)
            fresh = conn is None
            if conn is None:
                cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
                conn = self._conns[key] = cls(parts.hostname or "", parts.port, timeout=self.timeout_s)
            try:
                conn.request("GET", path, headers={"Accept": "text/plain"})
                resp = conn.getresponse()
                body = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                del self._conns[key]
                if fresh or attempt:
                    raise
                continue
            if resp.status != 200:
                raise OSError(f"metrics answered HTTP {resp.status}")
            return body.decode("utf-8", errors="replace")
        raise OSError("unreachable")  # pragma: no cover - the loop returns or raises

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


class EngineMetricsScraper:
    """Polls ``{backend: metrics_url}`` every ``interval_s``; never raises into the caller."""

    def __init__(self, targets: Mapping[str, str], sink: Callable[[str, ExternalSignal], None], *,
                 capacity_sink: Callable[[str, int], None] | None = None,
                 block_size_sink: Callable[[str, int], None] | None = None,
                 emptied_sink: Callable[[str, float], None] | None = None,
                 interval_s: float = 1.0, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = dict(targets)
        self.sink = sink
        self.capacity_sink = capacity_sink
        self.block_size_sink = block_size_sink
        self.emptied_sink = emptied_sink
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.snapshots: dict[str, EngineSnapshot] = {}
        self.failures: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: _KeepAliveGet | None = None

    def scrape_once(self) -> dict[str, EngineSnapshot | None]:
        """Scrape every target once (also what the thread does each interval)."""
        if self._client is None:
            self._client = _KeepAliveGet(self.timeout_s)
        out: dict[str, EngineSnapshot | None] = {}
        for backend, url in self.targets.items():
            out[backend] = self._scrape(backend, url)
        return out

    def _scrape(self, backend: str, url: str) -> EngineSnapshot | None:
        assert self._client is not None
        at = self.clock()
        try:
            snap = parse_metrics(self._client.get(url))
            if snap.engine is None and snap.block_size is None:
                raise ValueError("no known engine metrics")
        except Exception as exc:
            self.failures[backend] = self.failures.get(backend, 0) + 1
            outcome = "malformed" if isinstance(exc, ValueError) else "unreachable"
            pm.ENGINE_SCRAPES.labels(backend, outcome).inc()
            log.debug("metrics scrape of %s failed: %s", backend, type(exc).__name__)
            return None
        pm.ENGINE_SCRAPES.labels(backend, "ok").inc()
        snap.read_at = at
        before = self.snapshots.get(backend)
        self.snapshots[backend] = snap
        kv = snap.kv_usage
        if kv is not None and kv > 1.0:  # some exporters report percent
            kv = kv / 100.0
        try:
            if self.emptied_sink is not None and before is not None and restarted(before, snap):
                log.info("kvroute: %s restarted (its prompt-token counter went back): it holds no prefix now", backend)
                self.emptied_sink(backend, before.read_at if before.read_at is not None else at)
            self.sink(backend, ExternalSignal(at=at, queue_depth=snap.queue_depth, running=snap.running,
                                              kv_usage=kv))
            capacity = snap.capacity_tokens
            if capacity is not None and self.capacity_sink is not None and self._capacity.get(backend) != capacity:
                self._capacity[backend] = capacity
                self.capacity_sink(backend, capacity)
            if snap.block_size and self.block_size_sink is not None:
                self.block_size_sink(backend, snap.block_size)
        except Exception:
            log.exception("metrics sink failed for %s", backend)
        return snap

    def start(self) -> EngineMetricsScraper:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvroute-engine-metrics", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_once()
            except Exception:  # pragma: no cover - scrape_once already guards each target
                log.exception("metrics scrape round failed")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None
