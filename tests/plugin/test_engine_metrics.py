"""Engine metrics: parsing vLLM / SGLang / llama.cpp exposition, scraping over HTTP, degrading when it fails."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar

import pytest
from loopback import QuietHandler, http_stub

from kvroute.plugin.feeds.engine_metrics import EngineMetricsScraper, EngineSnapshot, hit_rate, parse_metrics
from kvroute.policies import Router
from kvroute.policies.load import ExternalSignal

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kvevents"

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.75
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 600.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="40"} 1.0
"""

SGLANG = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",tp_rank="1"} 1.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
sglang:token_usage{model_name="m",tp_rank="1"} 0.25
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 2048
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""


def test_vllm_metrics_with_cache_config():
    snap = parse_metrics(VLLM)
    assert snap.engine == "vllm"
    assert (snap.queue_depth, snap.running, snap.kv_usage) == (5.0, 2.0, 0.75)
    assert (snap.cache_hits, snap.cache_queries) == (600.0, 1000.0)
    assert (snap.block_size, snap.num_gpu_blocks, snap.capacity_tokens) == (128, 40, 5120)


def test_sglang_sums_queues_and_averages_usage_over_ranks():
    snap = parse_metrics(SGLANG)
    assert snap.engine == "sglang"
    assert (snap.queue_depth, snap.running, snap.kv_usage) == (4.0, 4.0, 0.375)
    assert snap.capacity_tokens is None


def test_llamacpp_metrics():
    snap = parse_metrics(LLAMACPP)
    assert snap.engine == "llamacpp" and snap.queue_depth == 2 and snap.running == 1 and snap.kv_usage is None


def test_recorded_vllm_metrics_page():
    path = FIXTURES / "vllm-0.32-cpu-metrics.txt"
    assert path.exists(), f"recorded {path} absent (captured from bench/vllm_precise_e2e.py replicas)"
    snap = parse_metrics(path.read_text())
    assert snap.engine == "vllm" and snap.block_size and snap.num_gpu_blocks
    assert snap.queue_depth is not None and snap.running is not None and snap.kv_usage is not None


def test_only_the_metrics_read_reach_the_parser():
    from prometheus_client.parser import text_string_to_metric_families

    from kvroute.plugin.feeds.engine_metrics import _wanted_lines

    page = (FIXTURES / "vllm-0.32-cpu-metrics.txt").read_text()
    subset = _wanted_lines(page)
    assert len(subset) < len(page) / 4  # the histograms are skipped
    full = {s.name: s for f in text_string_to_metric_families(page) for s in f.samples}
    kept = {s.name: s for f in text_string_to_metric_families(subset) for s in f.samples}
    assert kept and all(full[name] == sample for name, sample in kept.items())
    assert {"vllm:num_requests_waiting", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"} <= set(kept)
    assert parse_metrics(page) == parse_metrics(subset)


def test_hit_rate_between_scrapes():
    a = EngineSnapshot(cache_hits=100, cache_queries=200)
    b = EngineSnapshot(cache_hits=160, cache_queries=300)
    assert hit_rate(a, b) == pytest.approx(0.6)
    assert hit_rate(b, b) is None and hit_rate(EngineSnapshot(), b) is None


class _Metrics(QuietHandler):
    pages: ClassVar[dict[str, tuple[int, str]]] = {}

    def do_GET(self):
        status, body = self.pages.get(self.path, (404, "not found"))
        self.reply(status, body.encode(), "text/plain; version=0.0.4")


@pytest.fixture
def metrics_server():
    _Metrics.pages = {"/vllm": (200, VLLM), "/garbage": (200, "this is {not prometheus"),
                      "/empty": (200, "# nothing here\n"), "/error": (500, "boom")}
    with http_stub(_Metrics) as url:
        yield url


def test_scraper_feeds_the_router_and_autotunes_capacity(metrics_server):
    now = [100.0]
    router = Router(clock=lambda: now[0])
    capacity: dict[str, int] = {}
    block_sizes: dict[str, int] = {}
    scraper = EngineMetricsScraper(
        {"a": metrics_server + "/vllm", "bad": metrics_server + "/garbage", "empty": metrics_server + "/empty",
         "err": metrics_server + "/error", "down": "http://127.0.0.1:9/metrics"},
        router.observe, capacity_sink=lambda b, t: (capacity.__setitem__(b, t), router.index.set_capacity(b, t)),
        block_size_sink=block_sizes.__setitem__, clock=router.clock, timeout_s=0.5)
    try:
        out = scraper.scrape_once()
    finally:
        scraper.stop()
    assert out["a"] is not None and all(out[b] is None for b in ("bad", "empty", "err", "down"))
    assert capacity == {"a": 5120} and block_sizes == {"a": 128}
    signal = router.load.signal("a")
    assert signal == ExternalSignal(at=100.0, queue_depth=5.0, running=2.0, kv_usage=0.75)
    assert router.load.signal("bad") is None  # failures leave router-side load only
    assert scraper.failures == {"bad": 1, "empty": 1, "err": 1, "down": 1}
    view = router.load.view("a", 100.0)
    assert view.running == 2 and view.kv_usage == 0.75
    assert router.load.view("a", 110.0).kv_usage < 0.1  # the signal ages out


def test_a_restarted_engine_is_reported_emptied_once(metrics_server):
    """The prompt-token counter only grows while the engine lives: when a scrape reads it lower than the last
    one, the engine restarted with an empty cache, and the index hears it once, with when the old engine was last
    read; a scrape that failed between them, or a counter that grew, says nothing."""
    emptied: list[tuple[str, float]] = []
    now = [10.0]
    restarted = LLAMACPP.replace("llamacpp:prompt_tokens_total 2048", "llamacpp:prompt_tokens_total 12")
    grown = LLAMACPP.replace("llamacpp:prompt_tokens_total 2048", "llamacpp:prompt_tokens_total 900")
    _Metrics.pages["/llama"] = (200, LLAMACPP)
    scraper = EngineMetricsScraper({"a": metrics_server + "/llama"}, lambda b, s: None,
                                   emptied_sink=lambda b, t: emptied.append((b, t)), timeout_s=0.5,
                                   clock=lambda: now[0])
    try:
        scraper.scrape_once()
        now[0] = 11.0
        scraper.scrape_once()
        assert emptied == []
        now[0] = 12.0
        _Metrics.pages["/llama"] = (500, "starting")
        scraper.scrape_once()
        now[0] = 13.0
        _Metrics.pages["/llama"] = (200, restarted)
        scraper.scrape_once()
        assert emptied == [("a", 11.0)]  # the old engine was last read at 11.0: it restarted after that
        now[0] = 14.0
        _Metrics.pages["/llama"] = (200, grown)
        scraper.scrape_once()
        assert emptied == [("a", 11.0)]
    finally:
        scraper.stop()


def test_scraper_thread_runs_on_an_interval(metrics_server):
    seen: list[str] = []
    scraper = EngineMetricsScraper({"a": metrics_server + "/vllm"}, lambda b, s: seen.append(b), interval_s=0.05)
    scraper.start()
    try:
        deadline = threading.Event()
        for _ in range(100):
            if len(seen) >= 3:
                break
            deadline.wait(0.02)
    finally:
        scraper.stop()
    assert len(seen) >= 3


class _DropsIdle(QuietHandler):
    """Answers as HTTP/1.1 keep-alive, then closes the socket anyway: a server that dropped an idle connection."""

    protocol_version = "HTTP/1.1"
    served: ClassVar[list[int]] = []

    def do_GET(self):
        self.served.append(1)
        self.reply(200, VLLM.encode(), "text/plain; version=0.0.4")
        self.close_connection = True


def test_scraper_reconnects_when_a_kept_alive_connection_was_dropped():
    seen: list[str] = []
    _DropsIdle.served = []
    with http_stub(_DropsIdle) as url:
        scraper = EngineMetricsScraper({"a": url + "/metrics"}, lambda b, s: seen.append(b), timeout_s=1.0)
        try:
            results = [scraper.scrape_once()["a"] for _ in range(3)]
        finally:
            scraper.stop()
    assert all(r is not None and r.engine == "vllm" for r in results)
    assert seen == ["a"] * 3 and len(_DropsIdle.served) == 3 and scraper.failures == {}
