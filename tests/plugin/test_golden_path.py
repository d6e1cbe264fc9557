"""The README's quick start as written, checked to the money: ``examples/config.yaml`` and ``examples/prices.yaml``
untouched, ``examples/env.sh`` (the fake engines' ports set before sourcing it, as it allows), fake engines, a real
``litellm --config examples/config.yaml`` proxy with billing at its default, ``kvroute billing load-prices``, then
traffic from two apps' keys (``kvroute.apps`` in the example config) and the master key, streamed and not, to the
self-hosted group, the hosted fallback (every replica faulted) and the hosted group, and ``kvroute report
margin``/``usage`` for the month through the CLI.

Every report row -- route kind, provider, rule, cost, markup, fee, billed, platform fee, margin -- is checked
against money this test computes itself with ``Decimal`` from the price file's YAML and the token counts each
engine reported to the client (usage of the response, or of the stream's last chunk).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import defaultdict
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

import httpx
import pytest
import yaml
from test_examples_proxy import EXAMPLES, KVROUTE, NetworkRecorder, example_env

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

KEYS = {"acme": "sk-acme-local", "beta": "sk-beta-local", "unattributed": "sk-kvroute-local"}  # README's keys
M = Decimal(10**6)
EXACT = Decimal("1e-9")  # amounts are a few 1e-4 USD: checked far below a cent (LiteLLM's hosted cost is a float)


def sourced_env(preset: dict[str, str]) -> dict[str, str]:
    """What ``. examples/env.sh`` exports on top of ``preset`` (variables already set keep their value)."""
    out = subprocess.run(["bash", "-c", f". {EXAMPLES / 'env.sh'} && env -0"], capture_output=True, check=True,
                         env={"PATH": os.environ["PATH"], **preset}).stdout.decode()
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in env.items() if k.startswith("EXAMPLE_") or k == "LITELLM_LOCAL_MODEL_COST_MAP"}


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}


def kvroute(args: list[str], cwd: Path) -> str:
    out = subprocess.run([*KVROUTE, *args], capture_output=True, text=True, cwd=cwd, env=cli_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# --- the independent computation: the price file's terms, read from its YAML here --------------------------------
PRICES = yaml.safe_load((EXAMPLES / "prices.yaml").read_text())


def per_mtok(backend: str) -> dict[str, Decimal]:
    """A backend's $/Mtok by token bucket; a GPU-hour card: gpu_hour × gpus × 1e6 / (tok_s × 3600), half-even 1e-6."""
    spec = next(b for b in PRICES["backends"] if b["id"] == backend)
    rate = spec["rates"][0]
    if "gpu_hour" in rate:
        hour = Decimal(str(rate["gpu_hour"]).split()[0]) * int(rate.get("gpus", 1))

        def card(tok_s: object) -> Decimal:
            return (hour * M / (Decimal(str(tok_s)) * 3600)).quantize(Decimal("1e-6"), ROUND_HALF_EVEN)
        return {"input": card(rate["prefill_tok_s"]), "cache_read": Decimal(str(rate.get("cache_read_per_mtok", 0))),
                "output": card(rate["decode_tok_s"])}
    return {"input": Decimal(rate["input_per_mtok"]), "cache_read": Decimal(rate["cache_read_per_mtok"]),
            "output": Decimal(rate["output_per_mtok"])}


def identity(backend: str) -> tuple[str, str]:
    spec = next(b for b in PRICES["backends"] if b["id"] == backend)
    return spec["provider"], spec["route_kind"]


def book(app: str) -> dict:
    return next((b for b in PRICES["price_books"] if b.get("app") == app), None) or next(
        b for b in PRICES["price_books"] if "app" not in b)


def rule_for(app: str, backend: str) -> dict:
    """The first rule of the app's book whose ``match`` holds for the backend (the file's order)."""
    provider, kind = identity(backend)
    for rule in book(app)["rules"]:
        match = rule.get("match") or {}
        if all({"route_kind": kind, "provider": provider, "backend": backend}.get(k) == v for k, v in match.items()):
            return rule
    raise AssertionError(f"no rule of {app} matches {backend}")


def expected_money(app: str, backend: str, uncached: int, cached: int, output: int) -> dict[str, Decimal]:
    """One successful request's money under the app's rule (markup and surcharges together, as reports show)."""
    rates, rule = per_mtok(backend), rule_for(app, backend)
    cost = (uncached * rates["input"] + cached * rates["cache_read"] + output * rates["output"]) / M
    markup = cost * Decimal(rule.get("markup_pct", "0"))
    surcharge = sum((n * Decimal(rule.get("surcharge_per_mtok", {}).get(k, "0"))
                     for k, n in (("input", uncached), ("cache_read", cached), ("output", output))), Decimal(0)) / M
    fee = Decimal(rule.get("fee_per_request", "0"))
    billed = cost + markup + surcharge + fee
    if rule.get("min_per_request") is not None and billed < Decimal(rule["min_per_request"]):
        billed = Decimal(rule["min_per_request"])  # the floor's difference is markup
    return {"provider_cost": cost, "markup_amount": billed - cost - fee, "fee_amount": fee, "billed_amount": billed}


# --- the stack and the traffic --------------------------------------------------------------------------------------
def chat(proxy: ProxyProcess, app: str, group: str, stream: bool, i: int) -> dict:
    """One request with the app's key; what the engine reported back (tokens) and who served it."""
    body = {"model": group, "stream": stream, "max_tokens": 6 + i % 3, "metadata": {"tags": ["golden", f"i:{i}"]},
            "messages": [{"role": "system", "content": "You answer questions about the golden path. " * 30},
                         {"role": "user", "content": f"{app} question {i} on {group}"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(trust_env=False, timeout=120) as client:
        resp = client.post(proxy.base_url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEYS[app]}", "X-Session-Id": f"{app}-conv-{i}"})
        assert resp.status_code == 200, resp.text[:300]
        if stream:
            chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
        else:
            usage = resp.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"app": app, "backend": resp.headers["x-litellm-model-id"], "uncached": usage["prompt_tokens"] - cached,
            "cached": cached, "output": usage["completion_tokens"], "stream": stream, "session": f"{app}-conv-{i}",
            "i": i}


def set_fault(base_url: str, mode: str | None) -> None:
    with httpx.Client(trust_env=False, timeout=10) as c:
        r = c.post(base_url + "/admin/fault", json={"mode": mode}) if mode else c.delete(base_url + "/admin/fault")
        r.raise_for_status()


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=200000, decode_ms=0.0, slots=4)
    workdir = tmp_path_factory.mktemp("quickstart")
    with NetworkRecorder() as recorder, Fleet(3, engine="fake", options=opts, name_prefix="gp-rep") as replicas, \
            Fleet(2, engine="fake", options=opts, name_prefix="gp-host") as hosted:
        env = sourced_env(example_env(replicas, hosted))
        with ProxyProcess(EXAMPLES / "config.yaml", env={**env, **recorder.env()}, workdir=workdir,
                          inherit_kvroute_env=False) as proxy:
            loaded = kvroute(["billing", "load-prices", str(EXAMPLES / "prices.yaml")], workdir)
            sent = []
            for i in range(2):
                for app in ("acme", "beta"):
                    for group in ("llama", "hosted"):
                        for stream in (False, True):
                            sent.append(chat(proxy, app, group, stream, i))
            sent.append(chat(proxy, "unattributed", "hosted", False, 0))
            refused = httpx.post(proxy.base_url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-nobody"},
                                 json={"model": "hosted", "messages": [{"role": "user", "content": "hi"}]},
                                 timeout=60, trust_env=False).status_code
            for url in replicas.base_urls:  # every replica fails: LiteLLM falls back to the hosted group
                set_fault(url, "500")
            fallback = [chat(proxy, app, "llama", stream, 5) for app in ("acme", "beta") for stream in (False, True)]
            for url in replicas.base_urls:
                set_fault(url, None)
            period = datetime.now(UTC).strftime("%Y-%m")
            deadline = time.monotonic() + 60
            while True:  # the drainer stores the journaled events a moment later
                usage = json.loads(kvroute(["report", "usage", "--period", period, "--format", "json"], workdir))
                done = sum(r["requests_total"] for r in usage["rows"]) >= len(sent) + len(fallback)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            margin = json.loads(kvroute(["report", "margin", "--period", period, "--format", "json"], workdir))
            sessions = json.loads(kvroute(["report", "usage", "--period", period, "--by", "session", "--format",
                                           "json"], workdir))
            tags = json.loads(kvroute(["report", "usage", "--period", period, "--by", "tag", "--format", "json"],
                                      workdir))
            metrics = httpx.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers, timeout=10,
                                trust_env=False).text
            yield {"proxy": proxy, "sent": sent, "fallback": fallback, "usage": usage, "margin": margin,
                   "loaded": loaded, "metrics": metrics, "recorder": recorder, "sessions": sessions, "tags": tags,
                   "refused": refused}


def test_load_prices_declares_the_examples_backends(golden):
    assert golden["loaded"].startswith("backends +5, rate cards +5, price books +2"), golden["loaded"]


def test_fallback_requests_were_served_by_the_hosted_group(golden):
    assert {r["backend"] for r in golden["fallback"]} <= {"provider-a", "provider-b"}
    assert any(r["backend"].startswith("replica-") for r in golden["sent"])  # the llama group served itself


def test_every_margin_row_matches_the_price_file_to_the_money(golden):
    want: dict[tuple[str, str], dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    served: dict[tuple[str, str], int] = defaultdict(int)
    for r in golden["sent"] + golden["fallback"]:
        key = (r["app"], r["backend"])
        served[key] += 1
        for k, v in expected_money(r["app"], r["backend"], r["uncached"], r["cached"], r["output"]).items():
            want[key][k] += v
    rows = golden["margin"]["rows"]
    keys = [(r["app_id"], r["backend_id"]) for r in rows]
    assert len(keys) == len(set(keys)), "a backend appears twice for one app: " + repr(sorted(
        (r["app_id"], r["backend_id"], r["provider"], r["route_kind"], r["served_model"], r["requests_total"])
        for r in rows))
    assert set(served) <= set(keys), (sorted(served), sorted(keys))
    lines = []
    for row in rows:
        app, backend = row["app_id"], row["backend_id"]
        provider, kind = identity(backend)
        assert (row["provider"], row["route_kind"], row["served_model"]) == (provider, kind, "fake-model"), row
        rule = rule_for(app, backend)
        got = {k: Decimal(str(row[k])) for k in ("provider_cost", "markup_amount", "fee_amount", "billed_amount",
                                                  "platform_fee", "margin_amount", "absorbed_cost")}
        exp = want.get((app, backend), defaultdict(Decimal))
        assert row["requests_total"] == served.get((app, backend), 0), row
        assert got["absorbed_cost"] == 0  # faulted replicas answered 500 before any token: nothing to absorb
        for k in ("provider_cost", "markup_amount", "fee_amount", "billed_amount"):
            assert abs(got[k] - exp[k]) <= EXACT, (app, backend, k, got[k], exp[k])
        platform = exp["billed_amount"] * Decimal(book(app).get("platform_fee_pct", "0"))
        assert abs(got["platform_fee"] - platform) <= EXACT, (app, backend, got["platform_fee"], platform)
        assert abs(got["margin_amount"] - (exp["billed_amount"] - exp["provider_cost"] - platform)) <= EXACT
        if served.get((app, backend)):
            assert row["pricing_rule"].startswith(rule["name"] + ":"), (row["pricing_rule"], rule["name"])
            assert got["billed_amount"] > got["provider_cost"]  # nobody is billed at cost
        lines.append(f"{app:13} {backend:10} {kind:11} {row['pricing_rule'][:40]:40} n={row['requests_total']:2} "
                     f"cost {got['provider_cost']:.6f} markup {got['markup_amount']:.6f} fee {got['fee_amount']:.4f}"
                     f" billed {got['billed_amount']:.6f}")
    print("\n" + "\n".join(sorted(lines)))
    hosted_acme = [r for r in rows if r["app_id"] == "acme" and r["route_kind"] == "marketplace"]
    assert hosted_acme and all(r["pricing_rule"].startswith("hosted:") for r in hosted_acme)


def test_usage_report_splits_self_hosted_and_hosted_by_the_same_route_kind(golden):
    for row in golden["usage"]["rows"]:
        cost = Decimal(str(row["provider_cost"])) + Decimal(str(row["absorbed_cost"]))
        self_hosted = identity(row["backend_id"])[1] == "self_hosted"
        assert (Decimal(str(row["self_hosted_cost"])), Decimal(str(row["hosted_cost"]))) == (
            (cost, Decimal(0)) if self_hosted else (Decimal(0), cost)), row


def test_the_session_header_and_metadata_tags_reach_the_ledger(golden):
    """``x-session-id`` and the request's metadata ``tags`` are on every row of the request, through the proxy."""
    want_sessions: dict[tuple[str, str], int] = defaultdict(int)
    want_tags: dict[tuple[str, str], int] = defaultdict(int)
    for r in golden["sent"] + golden["fallback"]:
        want_sessions[(r["app"], r["session"])] += 1
        for tag in ("golden", f"i:{r['i']}"):
            want_tags[(r["app"], tag)] += 1
    got = {(r["app_id"], r["session_id"]): r["requests_total"] for r in golden["sessions"]["rows"]}
    assert {k: v for k, v in got.items() if v} == want_sessions
    got = {(r["app_id"], r["tag"]): r["requests_total"] for r in golden["tags"]["rows"]}
    assert {k: v for k, v in got.items() if v} == want_tags
    assert all(r["sessions"] == 1 for r in golden["sessions"]["rows"] if r["session_id"] != "(none)")
    assert 'kvroute_app_requests_total{app="unattributed",outcome="success"} 1.0' in golden["metrics"]
    assert "kvroute_app_cost" not in golden["metrics"]


def test_an_unlisted_key_is_refused_and_no_key_is_logged(golden):
    assert golden["refused"] == 401
    log = golden["proxy"].log_text()
    assert not any(key in log for key in (*KEYS.values(), "sk-nobody"))


def test_master_key_traffic_is_unattributed_counted_and_warned(golden):
    assert {r["app_id"] for r in golden["margin"]["rows"]} == {"acme", "beta", "unattributed"}
    assert "kvroute_billing_unattributed_requests_total 1.0" in golden["metrics"]
    assert "1 request(s) booked as app 'unattributed'" in golden["proxy"].log_text()


def test_startup_line_names_the_default_ledger_and_nothing_reached_the_network(golden):
    line = next(ln for ln in golden["proxy"].log_text().splitlines() if "kvroute ready:" in ln)
    assert "billing sqlite .kvroute/billing.db (journal .kvroute/journal);" in line, line
    assert golden["recorder"].requests == [], golden["recorder"].requests
