"""Metrics: series recorded by the recorders, bounded app labels, served on a port."""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.metrics import OTHER, LabelLimiter, Metrics


def test_recorders_update_series():
    m = Metrics(CollectorRegistry(), max_app_labels=2)
    m.decision("llama", "cache_aware", "prefix_match", 512)
    m.completed("llama", "r0", "app1", 1000, 768, 0.05, (1200, 768))
    m.completed("llama", "r0", None, 10, None, None)
    m.failed("r1", "provider_failure", app="app1")
    m.breaker("r1", "open", "closed")
    m.error("filter")
    m.set_inflight([("r0", 3)])
    v = m.registry.get_sample_value
    assert v("kvroute_decisions_total", {"group": "llama", "policy": "cache_aware", "reason": "prefix_match"}) == 1
    assert v("kvroute_predicted_cached_tokens_total", {"group": "llama"}) == 512
    assert v("kvroute_confirmed_cached_tokens_total", {"group": "llama"}) == 768
    assert v("kvroute_ttft_seconds_count", {"backend": "r0"}) == 1
    assert v("kvroute_app_prompt_tokens_total", {"app": "app1"}) == 1200  # the ledger's count (cache writes in)
    assert v("kvroute_app_cached_tokens_total", {"app": "app1"}) == 768
    assert v("kvroute_app_requests_total", {"app": "unattributed", "outcome": "success"}) == 1  # the ledger's word
    assert v("kvroute_app_prompt_tokens_total", {"app": "unattributed"}) == 10
    assert "kvroute_app_cost" not in {f.name for f in m.registry.collect()}  # money is the ledger's alone
    assert v("kvroute_app_requests_total", {"app": "app1", "outcome": "provider_failure"}) == 1
    assert v("kvroute_breaker_state", {"backend": "r1", "state": "open"}) == 1
    assert v("kvroute_breaker_state", {"backend": "r1", "state": "closed"}) == 0
    assert v("kvroute_breaker_transitions_total", {"backend": "r1", "to": "open"}) == 1
    assert v("kvroute_plugin_errors_total", {"hook": "filter"}) == 1
    assert v("kvroute_inflight_requests", {"backend": "r0"}) == 3


@given(st.lists(st.text(min_size=1, max_size=8), max_size=60), st.integers(min_value=1, max_value=10))
def test_app_labels_are_bounded(apps, limit):
    lim = LabelLimiter(limit)
    labels = {lim(a) for a in apps}
    assert len(labels - {OTHER}) <= limit
    assert lim(None) == "unknown"


def test_serve_on_a_free_port():
    m = Metrics(CollectorRegistry())
    try:
        port = m.serve(0)
        assert m.serve(0) == port
        m.decision("g", "p", "r", 0)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
        assert "kvroute_decisions_total" in text
    finally:
        m.close()


def test_grafana_dashboard_uses_only_existing_series():
    import json
    import re
    from pathlib import Path

    m = Metrics(CollectorRegistry())
    m.completed("g", "b", "a", 1, 1, 0.1, (1, 1))
    m.hybrid_decision("g", "b", "hosted", "overflow_latency", 0.2)
    m.hybrid_state("g", 0.5, True, Decimal("1.5"), "USD")
    names = {s.name for metric in m.registry.collect() for s in metric.samples}
    names |= {f.name for f in m.registry.collect()}
    dash = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json").read_text())
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"kvroute_[a-z_]+", t["expr"])}
    assert used and used <= names | {n + "_total" for n in names}, used - names


def test_exposition_serves_only_kvroute_families():
    from prometheus_client import Counter

    registry = CollectorRegistry()
    m = Metrics(registry)
    Counter("litellm_requests", "someone else's series", ["hashed_api_key"], registry=registry).labels("abc").inc()
    m.decision("llama", "cache_aware", "cold", 0)
    body, content_type = m.exposition()
    text = body.decode()
    assert "kvroute_decisions_total" in text and "litellm_" not in text and "hashed_api_key" not in text
    assert content_type.startswith("text/plain")
    port = m.serve(0)
    try:
        served = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
    finally:
        m.close()
    assert "kvroute_decisions_total" in served and "litellm_" not in served


_WORKER = """
import sys
from prometheus_client import REGISTRY, Counter
from kvroute.plugin.adapter.metrics import Metrics
m = Metrics(REGISTRY, multiproc_dir=sys.argv[1])
Counter("litellm_other", "not ours", registry=REGISTRY).inc()
for _ in range(int(sys.argv[2])):
    m.decision("llama", "cache_aware", "prefix_match", 10)
m.set_inflight([("r0", int(sys.argv[2]))])
if sys.argv[3] == "read":
    sys.stdout.write(m.exposition()[0].decode())
"""


@pytest.mark.slow
def test_multiprocess_mode_sums_every_worker(tmp_path):
    """Three worker processes write to one PROMETHEUS_MULTIPROC_DIR; any one of them exposes the sum."""
    import os
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (2, 3):
        subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), str(n), "write"], env=env, check=True,
                       timeout=60)
    out = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), "4", "read"], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(out) for s in fam.samples}
    assert samples[("kvroute_decisions_total", (("group", "llama"), ("policy", "cache_aware"),
                                                ("reason", "prefix_match")))] == 9
    assert samples[("kvroute_predicted_cached_tokens_total", (("group", "llama"),))] == 90
    assert "litellm_other" not in out


def test_app_token_metrics_count_as_the_ledger_does():
    """The per-app prompt and cached counters read the response through the ledger's own normaliser, so a
    dashboard's cached share is the report's ``cache_hit_ratio`` for the same requests."""
    from kvroute.billing.usage import normalize_usage
    from kvroute.plugin.adapter.signals import ledger_tokens
    usage = {"prompt_tokens": 103050, "completion_tokens": 7, "cache_read_input_tokens": 100000,
             "cache_creation_input_tokens": 3000,
             "prompt_tokens_details": {"cached_tokens": 100000, "cache_write_tokens": 3000}}
    tokens = normalize_usage(usage)
    assert ledger_tokens({"usage": usage}) == (tokens.prompt_total, tokens.cache_read) == (103050, 100000)
    assert ledger_tokens({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}}) is None
    assert ledger_tokens({}) is None
