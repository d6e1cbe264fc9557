"""End to end: ``examples/config.yaml`` as written (URLs from ``os.environ/``) behind a real LiteLLM proxy, offline.

Every process runs with HTTP(S)_PROXY pointing at a loopback recorder that refuses and records each request, so
any reach for the network (a Hugging Face tokenizer download, a cost-map fetch) is seen; loopback traffic
bypasses it (NO_PROXY). A control shows the recorder does see LiteLLM's tokenizer fetch for a name it knows.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KVROUTE = [sys.executable, "-m", "kvroute.plugin.cli.cli"]


class NetworkRecorder:
    """An HTTP proxy on 127.0.0.1 that answers every request 403 and keeps its first line (``CONNECT host:443``)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def env(self) -> dict[str, str]:
        names = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
        return {**dict.fromkeys(names, self.url), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def _serve(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    first = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
                    self.requests.append(first)
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def __enter__(self) -> NetworkRecorder:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)


def example_variables() -> list[str]:
    """The variable names examples/env.sh sets (and examples/config.yaml reads)."""
    out = subprocess.run(["bash", "-c", f". {EXAMPLES / 'env.sh'} && env"], capture_output=True, text=True,
                         check=True, env={"PATH": os.environ["PATH"]}).stdout
    return sorted(line.split("=", 1)[0] for line in out.splitlines() if line.startswith("EXAMPLE_"))


def example_env(replicas: Fleet, hosted: Fleet) -> dict[str, str]:
    env: dict[str, str] = {}
    for i, base in enumerate(replicas.base_urls, start=1):
        env[f"EXAMPLE_REPLICA_{i}_API_BASE"] = base + "/v1"
        env[f"EXAMPLE_REPLICA_{i}_METRICS_URL"] = base + "/metrics"
    for name, base in zip("AB", hosted.base_urls, strict=True):
        env[f"EXAMPLE_PROVIDER_{name}_API_BASE"] = base + "/v1"
    return env


@pytest.fixture(scope="module")
def stack():
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=200000, decode_ms=0.0, slots=4)
    with NetworkRecorder() as recorder, Fleet(3, engine="fake", options=opts, name_prefix="ex-rep") as replicas, \
            Fleet(2, engine="fake", options=opts, name_prefix="ex-host") as hosted:
        env = example_env(replicas, hosted)
        config = yaml.safe_load((EXAMPLES / "config.yaml").read_text())  # as written: os.environ/ references
        with ProxyProcess(config, env={**env, **recorder.env()}, inherit_kvroute_env=False) as proxy:
            yield {"proxy": proxy, "env": env, "recorder": recorder}


def test_env_sh_sets_every_variable_the_example_config_reads():
    # what the config reads: commented-out lines (options shown, not set) read nothing
    text = "\n".join(line.split("#", 1)[0] for line in (EXAMPLES / "config.yaml").read_text().splitlines())
    read = sorted({word.split("/", 1)[1].rstrip(",}") for word in text.split() if word.startswith("os.environ/")})
    assert read and read == example_variables()


def _chat(proxy: ProxyProcess, group: str, stream: bool, i: int) -> str:
    body = {"model": group, "stream": stream, "max_tokens": 8,
            "messages": [{"role": "system", "content": "You answer questions about the example. " * 40},
                         {"role": "user", "content": f"question {i}"}]}
    with httpx.Client(trust_env=False, timeout=60) as client:
        resp = client.post(proxy.base_url + "/v1/chat/completions", headers=proxy.headers, json=body)
    assert resp.status_code == 200, resp.text[:300]
    return resp.text


def test_example_config_serves_both_groups_streamed_and_not_without_touching_the_network(stack):
    proxy, recorder = stack["proxy"], stack["recorder"]
    for i in range(3):
        for group in ("llama", "hosted"):
            assert "data:" in _chat(proxy, group, True, i)
            assert '"choices"' in _chat(proxy, group, False, i)
    status = httpx.get(proxy.base_url + "/kvroute/status?show=api_base", headers=proxy.headers, timeout=10,
                       trust_env=False).json()
    backends = status["backends"]
    assert {"replica-1", "replica-2", "replica-3", "provider-a", "provider-b"} <= set(backends)
    assert backends["replica-1"]["api_base"] == stack["env"]["EXAMPLE_REPLICA_1_API_BASE"]
    assert sum(b["index_blocks"] for b in backends.values()) > 0
    assert recorder.requests == [], recorder.requests


def test_proxy_log_has_kvroute_startup_line(stack):
    log = stack["proxy"].log_text()
    line = next((ln for ln in log.splitlines() if "kvroute ready:" in ln), None)
    assert line is not None, log[-2000:]
    assert "hosted (marketplace, approx, 2 hosted)" in line
    assert "llama (cache_aware, approx, 3 self-hosted; metrics scraped)" in line
    assert "billing sqlite .kvroute/billing.db (journal .kvroute/journal);" in line, line  # on by default
    assert "redis off" in line and "/kvroute/status" in line


def test_status_prints_table_csv_and_json(stack):
    proxy = stack["proxy"]
    base = [*KVROUTE, "status", "--proxy", proxy.base_url, "--api-key", proxy.master_key or ""]
    as_csv = subprocess.run([*base, "--format", "csv"], capture_output=True, text=True, timeout=60)
    assert as_csv.returncode == 0, as_csv.stderr
    rows = {r["backend"]: r for r in csv.DictReader(io.StringIO(as_csv.stdout))}
    assert rows["replica-2"]["group"] == "llama" and rows["provider-a"]["kind"] == "hosted"
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert set(json.loads(as_json.stdout)["backends"]) == set(rows)
    table = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert "…" not in table.stdout and all(name in table.stdout for name in rows)
    env = {k: v for k, v in os.environ.items() if k != "LITELLM_MASTER_KEY"}
    keyless = subprocess.run([*KVROUTE, "status", "--proxy", proxy.base_url], capture_output=True, text=True,
                             timeout=60, env=env)
    assert keyless.returncode == 2 and keyless.stderr == (
        f"error: {proxy.base_url}/kvroute/status answered 401: no key was sent: pass --api-key or set "
        "LITELLM_MASTER_KEY (the master key or an admin key)\n"), keyless.stderr


def test_check_live_reaches_replicas_metrics_redis_and_billing_db(stack, redis_url, tmp_path):
    db = os.environ.get("KVROUTE_TEST_PG_URL") or str(tmp_path / "billing.db")
    env = {**os.environ, **stack["env"], "KVROUTE_REDIS_URL": redis_url, "KVROUTE_BILLING_DB": db,
           "KVROUTE_HASH_SECRET": "examples-check-secret-0123456789"}
    out = subprocess.run([*KVROUTE, "check", str(EXAMPLES / "config.yaml"), "--live"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for rid in ("replica-1", "replica-2", "replica-3"):
        assert any(ln.startswith(f"ok   {rid} api_base:") and "answers 200" in ln for ln in lines), lines
        assert any(ln.startswith(f"ok   {rid} metrics_url:") for ln in lines), lines
    assert any(ln.startswith("ok   provider-a api_base:") for ln in lines), lines
    assert any(ln.startswith("ok   redis:") and "answers PING" in ln for ln in lines), lines
    assert any(ln.startswith("ok   billing db:") for ln in lines), lines
    assert "note: KVROUTE_REDIS_URL overrides kvroute.redis_url" in lines


def test_demo_on_fake_engines_stays_offline_and_prints_csv(tmp_path):
    with NetworkRecorder() as recorder:
        env = {**os.environ, **recorder.env()}
        env = {k: v for k, v in env.items() if not k.startswith("KVROUTE_")}
        out = subprocess.run([*KVROUTE, "demo", "--engine", "fake", "--replicas", "2", "--requests", "8",
                              "--format", "csv"], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = list(csv.DictReader(io.StringIO(out.stdout)))
        assert [r["policy"] for r in rows] == ["kvroute", "round_robin"]
        assert all(r["failed"] == "0" for r in rows)
        assert "starting 2 fake replicas per policy, 4 in all" in out.stderr
        assert recorder.requests == [], recorder.requests


def test_control_recorder_sees_litellm_fetch_a_tokenizer_for_a_name_it_knows():
    """The same recorder catches LiteLLM's (native) Hugging Face download for a ``llama-2`` model name."""
    code = ("import litellm; litellm.token_counter(model='llama-2', messages=[{'role': 'user', 'content': 'hi'}])")
    with NetworkRecorder() as recorder:
        subprocess.run([sys.executable, "-c", code], env={**os.environ, **recorder.env()}, capture_output=True,
                       timeout=120, check=True)
        assert any("huggingface.co" in r for r in recorder.requests), recorder.requests


def test_sdk_example_runs_as_written_against_fake_replicas():
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=200000, decode_ms=0.0, slots=4)
    with NetworkRecorder() as recorder, Fleet(3, engine="fake", options=opts, name_prefix="ex-sdk") as replicas:
        env = {**os.environ, **recorder.env(), "API_BASES": ",".join(replicas.api_bases)}
        env = {k: v for k, v in env.items() if not k.startswith("KVROUTE_")}
        out = subprocess.run([sys.executable, str(EXAMPLES / "sdk_router.py")], capture_output=True, text=True,
                             env=env, timeout=180, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        turns = [ln for ln in out.stdout.splitlines() if ln.startswith("chat ")]
        assert len(turns) == 12 and all("replica-" in ln for ln in turns)
        config = yaml.safe_load((EXAMPLES / "config.yaml").read_text())
        names = {d["model_info"]["id"] for d in config["model_list"] if d["model_name"] == "llama"}
        assert {ln.split(": ", 1)[1].split()[0] for ln in turns} <= names  # replica-1..3, as the proxy config
        assert out.stdout.startswith("billing off: the SDK records usage only when asked"), out.stdout[:200]
        cached = [int(ln.split(" cached ", 1)[1].split("/", 1)[0]) for ln in turns]
        assert sum(cached[3:]) > 0  # later turns reuse the shared system prompt on the replica that holds it
        assert recorder.requests == [], recorder.requests


def _usage_of(resp: httpx.Response, stream: bool) -> dict:
    if not stream:
        return resp.json()["usage"]
    chunks = [json.loads(line[5:]) for line in resp.text.splitlines()
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    return next(c["usage"] for c in reversed(chunks) if c.get("usage"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("repeats", [110, 450], ids=["1.5k", "6k"])
def test_repeats_of_one_long_prompt_stay_on_the_first_replica_and_are_cached(stack, repeats, stream):
    """A user's first test: the same long prompt, one request at a time, to the example's idle replicas. Every
    repeat goes to the replica that served the first and the engine reports the prefix cached."""
    proxy = stack["proxy"]
    system = f"Case {repeats}-{stream}. " + "You are a careful assistant for contract law questions. " * repeats
    seen = []
    with httpx.Client(trust_env=False, timeout=60) as client:
        for i in range(5):
            body = {"model": "llama", "stream": stream, "max_tokens": 8,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}
            if stream:
                body["stream_options"] = {"include_usage": True}
            resp = client.post(proxy.base_url + "/v1/chat/completions", headers=proxy.headers, json=body)
            assert resp.status_code == 200, resp.text[:300]
            usage = _usage_of(resp, stream)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            seen.append((resp.headers.get("x-litellm-model-id"), usage["prompt_tokens"], cached))
    assert seen[0][0] and all(b == seen[0][0] for b, _, _ in seen), seen
    assert all(cached >= 0.9 * prompt for _, prompt, cached in seen[1:]), seen
