"""Approximate groups with ``metrics_url`` scrape their replicas: aged load signals and index capacity autotune."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loopback import QuietHandler, http_stub
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings

VLLM_PAGE = (Path(__file__).parents[1] / "fixtures" / "kvevents" / "vllm-0.32-cpu-metrics.txt").read_text()


class _Engine(QuietHandler):
    def do_GET(self):
        if self.path == "/metrics":
            self.reply(200, VLLM_PAGE.encode(), "text/plain; version=0.0.4")
        else:
            self.reply(404, b"", "text/plain")


def test_replica_metrics_feed_load_and_autotune_capacity():
    with http_stub(_Engine) as url:
        deps = [{"model_name": "llama", "litellm_params": {"model": "openai/m", "api_base": f"{url}/v1"},
                 "model_info": {"id": "live", "engine": "vllm", "metrics_url": f"{url}/metrics"}},
                {"model_name": "llama", "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"},
                 "model_info": {"id": "dead", "engine": "vllm", "metrics_url": "http://127.0.0.1:9/metrics"}}]
        cb = KvrouteCallback(KvrouteSettings(metrics_scrape_interval_s=0.05), metrics=Metrics(CollectorRegistry()),
                             mount=False)
        try:
            msgs = [{"role": "system", "content": "shared prefix " * 300}, {"role": "user", "content": "q"}]
            picked = asyncio.run(cb.async_filter_deployments("llama", deps, msgs, {"messages": msgs}))
            assert len(picked) == 1
            router = cb.routers["llama"]
            deadline = time.monotonic() + 10
            while router.load.signal("live") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            signal = router.load.signal("live")
            assert signal is not None and signal.kv_usage is not None
            scraper = cb.scrapers["llama"]
            snap = scraper.snapshots["live"]
            asyncio.run(cb.async_filter_deployments("llama", deps, msgs, {"messages": msgs}))  # it applies the capacity
            assert snap.capacity_tokens and router.index.capacity_blocks("live") == int(
                snap.capacity_tokens // router.index.config.block_tokens)
            assert router.load.signal("dead") is None  # unreachable: router-side load only
        finally:
            asyncio.run(cb.aclose())
