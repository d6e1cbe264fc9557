"""With the shipped apps (``examples/config.yaml``: acme and beta), a second app learns nothing of the first's prompts.

A real LiteLLM proxy runs the example config as written; every replica URL points at one fake vLLM engine, so
whichever replica kvroute picks, the probe meets the engine cache the first app filled: a cached-token count
above 0 would tell the second app that the first sent that prompt. With the default (two apps: one key space
per app) the second app's first request comes back with 0 cached tokens, while the first app still reuses its
own prompt. The control is the same config with ``isolation: none``: there the second app's probe is a hit.
"""

from __future__ import annotations

import httpx
import pytest
import yaml
from test_examples_proxy import EXAMPLES, example_variables

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

KEYS = {"acme": "sk-acme-local", "beta": "sk-beta-local"}  # the example's apps, as the README gives them
SECRET_DOCUMENT = "Quarterly board memo, draft 3: the merger with Northwind closes on the 14th. " * 20


def probe(proxy: ProxyProcess, app: str, question: str) -> tuple[int, str]:
    """(cached tokens, served by) of one request as ``app`` whose prompt starts with the secret document."""
    body = {"model": "llama", "max_tokens": 4,
            "messages": [{"role": "system", "content": SECRET_DOCUMENT}, {"role": "user", "content": question}]}
    with httpx.Client(trust_env=False, timeout=60) as client:
        resp = client.post(proxy.base_url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEYS[app]}"})
    assert resp.status_code == 200, resp.text[:300]
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0, resp.headers["x-litellm-model-id"]


def run_probe(config: dict, tmp_path, name: str) -> dict[str, object]:
    opts = ReplicaOptions(capacity_tokens=65536, prefill_tokens_per_s=200000, decode_ms=0.0, slots=4)
    with Fleet(1, engine="fake", options=opts, name_prefix=f"iso-{name}") as engine:
        base = engine.base_urls[0]
        env = {var: base + ("/metrics" if var.endswith("METRICS_URL") else "/v1") for var in example_variables()}
        with ProxyProcess(config, env=env, inherit_kvroute_env=False, workdir=tmp_path / name) as proxy:
            acme_first = probe(proxy, "acme", "What closes on the 14th?")
            acme_again = probe(proxy, "acme", "Who is the merger with?")
            beta_first = probe(proxy, "beta", "Is there a merger?")
            line = next(ln for ln in proxy.log_text().splitlines() if "kvroute ready:" in ln)
    return {"acme_first": acme_first[0], "acme_again": acme_again[0], "beta_first": beta_first[0], "line": line}


def test_with_the_shipped_apps_a_second_app_learns_nothing_of_the_first(tmp_path):
    shipped = yaml.safe_load((EXAMPLES / "config.yaml").read_text())
    assert len(shipped["kvroute"]["apps"]) == 2 and "isolation" not in str(shipped["kvroute"])  # the default
    got = run_probe(shipped, tmp_path, "shipped")
    assert got["acme_first"] == 0 and got["acme_again"] >= 256, got  # an app still reuses its own prompt
    assert got["beta_first"] == 0, got
    assert "isolation app (default: 2 apps)" in str(got["line"]), got["line"]


def test_control_without_isolation_the_second_app_sees_the_first_apps_prompt(tmp_path):
    shared = yaml.safe_load((EXAMPLES / "config.yaml").read_text())
    shared["kvroute"]["isolation"] = "none"
    got = run_probe(shared, tmp_path, "none")
    assert got["beta_first"] >= 256, got  # the side channel the default closes
    assert "isolation none (set by kvroute.isolation)" in str(got["line"]), got["line"]
