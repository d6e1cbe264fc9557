"""``kvroute check CONFIG``: every problem of a proxy config on its own line, exit 1; ``--live`` says what answers.

The live case against running replicas, Redis and the billing database is in tests/plugin/test_examples_proxy.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "config.yaml"
KVROUTE = [sys.executable, "-m", "kvroute.plugin.cli.cli"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_env(base: str = "http://127.0.0.1:9") -> dict[str, str]:
    env = {f"EXAMPLE_REPLICA_{i}_API_BASE": f"{base}/v1" for i in (1, 2, 3)}
    env |= {f"EXAMPLE_REPLICA_{i}_METRICS_URL": f"{base}/metrics" for i in (1, 2, 3)}
    env |= {f"EXAMPLE_PROVIDER_{p}_API_BASE": f"{base}/v1" for p in "AB"}
    return env


def check(path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTE_", "EXAMPLE_"))}
    return subprocess.run([*KVROUTE, "check", str(path), *args], capture_output=True, text=True,
                          env={**environ, **env}, timeout=120)


def problems(out: subprocess.CompletedProcess, path: Path) -> list[str]:
    return [ln.removeprefix(f"{path}: ") for ln in out.stdout.splitlines() if ln.startswith(f"{path}: ")]


def test_example_config_is_valid_once_its_variables_are_set():
    out = check(EXAMPLE, **example_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == (f"{EXAMPLE}: ok (2 groups: hosted, llama; 3 self-hosted, 2 hosted deployments)")


def test_unset_variables_are_each_reported():
    out = check(EXAMPLE)
    assert out.returncode == 2
    found = problems(out, EXAMPLE)
    assert "model_list.0.litellm_params.api_base: os.environ/EXAMPLE_REPLICA_1_API_BASE is not set" in found
    assert "model_list.2.model_info.metrics_url: os.environ/EXAMPLE_REPLICA_3_METRICS_URL is not set" in found
    assert sum("is not set" in p for p in found) == 8


def test_every_problem_is_listed_one_per_line(tmp_path):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["model_list"][0]["model_info"]["engine"] = "vllmx"
    del cfg["model_list"][1]["model_info"]["id"]
    cfg["model_list"][2]["model_info"]["block_size"] = 0
    cfg["model_list"][3]["model_info"]["id"] = "provider-b"
    cfg["litellm_settings"]["callbacks"] = ["kvroute.plugin.kvroute_callbak"]
    cfg["router_settings"]["fallbacks"] = [{"llama": ["hostd"]}]
    cfg["kvroute"]["groups"]["llama"]["policy"] = "cache_awre"
    cfg["kvroute"]["groups"]["lama"] = {"policy": "cache_aware", "mode": "exact"}
    cfg["kvroute"]["metrics_port"] = 99999
    cfg["kvroute"]["rules"][1]["match"]["group"] = "nothere"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = check(path, KVROUTE_REDIS_ULR="redis://127.0.0.1/0", **example_env())
    assert out.returncode == 2
    found = problems(out, path)
    expected = [
        "KVROUTE_REDIS_ULR: unknown kvroute setting (did you mean KVROUTE_REDIS_URL?)",
        "kvroute.groups.lama.mode: Input should be 'approx' or 'precise'",
        "kvroute.metrics_port: must be a TCP port (0-65535)",
        "kvroute.groups.llama.policy: unknown policy 'cache_awre' (did you mean cache_aware?)",
        "model_list.0.model_info.engine: unknown engine 'vllmx'; known: vllm, sglang, llamacpp",
        "model_list.1.model_info.id: every deployment kvroute routes needs an id",
        "model_list.2.model_info.block_size: must be > 0, got 0",
        "model_list.4.model_info.id: 'provider-b' is also model_list.3's id",
        'litellm_settings.callbacks: must list "kvroute.plugin.kvroute_callback" '
        "(found 'kvroute.plugin.kvroute_callbak')",
        "router_settings.fallbacks.0: no model group 'hostd'",
        "kvroute.rules.1.match.group: no model group 'nothere'",
    ]
    for line in expected:
        assert any(p.startswith(line) for p in found), (line, found)
    assert len(found) == len(expected), found
    assert f"{len(expected)} problem(s) in {path}" in out.stderr


@pytest.mark.parametrize(("edit", "line"), [
    (lambda k: k.update(default_polcy="cache_aware"),
     "kvroute.default_polcy: unknown key (did you mean default_policy?)"),
    (lambda k: k["groups"]["llama"].update(isolaton="app"),
     "kvroute.groups.llama.isolaton: unknown key (did you mean isolation?)"),
    (lambda k: k["groups"]["llama"]["knobs"].update(min_prefx_tokens=1),
     "kvroute.groups.llama.knobs.min_prefx_tokens: unknown knob for cache_aware (did you mean min_prefix_tokens?)"),
    (lambda k: k["rules"][0].update(knobs={"max_scord": 1}),
     "kvroute.rules.0.knobs.max_scord: unknown knob for least_load (known: none)"),
    (lambda k: k["breaker"].update(base_cooldown=1),
     "kvroute.breaker.base_cooldown: unknown breaker setting (did you mean base_cooldown_s?)"),
])
def test_a_typo_is_named_at_its_own_path_with_the_key_it_may_mean(tmp_path, edit, line):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    edit(cfg["kvroute"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = check(path, **example_env())
    assert out.returncode == 2
    assert problems(out, path) == [line]


def test_unreadable_and_missing_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    out = check(missing)
    assert out.returncode == 2 and problems(out, missing) == ["no such file"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("model_list: [\n")
    out = check(broken)
    assert out.returncode == 2 and problems(out, broken)[0].startswith("cannot read it as YAML")


@pytest.mark.slow
def test_live_says_what_does_not_answer(tmp_path):
    port = closed_port()
    out = check(EXAMPLE, "--live", "--timeout", "1", **example_env(f"http://127.0.0.1:{port}"),
                KVROUTE_REDIS_URL=f"redis://127.0.0.1:{port}/0", KVROUTE_HASH_SECRET="live-check-secret-0123456789",
                KVROUTE_BILLING_DB=f"postgresql+psycopg://kvroute@127.0.0.1:{port}/x")
    assert out.returncode == 2
    lines = out.stdout.splitlines()
    assert f"FAIL replica-1 api_base: http://127.0.0.1:{port}/v1/models does not answer (ConnectError)" in lines
    assert f"FAIL replica-1 metrics_url: http://127.0.0.1:{port}/metrics does not answer (ConnectError)" in lines
    assert f"FAIL redis: redis://127.0.0.1:{port}/0 does not answer (ConnectionError)" in lines
    db = next(ln for ln in lines if ln.startswith("FAIL billing db:"))
    assert "Connection refused" in db
    assert "10 of 10 live checks failed" in out.stderr


def test_redis_without_a_hash_secret_is_a_problem_and_a_bad_url_one_line():
    out = check(EXAMPLE, **example_env(), KVROUTE_REDIS_URL="redis://127.0.0.1:6379/0")
    assert out.returncode == 2
    assert any(p.startswith("kvroute.hash_secret: required with redis_url") for p in problems(out, EXAMPLE))
    ok = check(EXAMPLE, **example_env(), KVROUTE_REDIS_URL="rediss://:pw@127.0.0.1:6380/0",
               KVROUTE_HASH_SECRET="a-long-enough-secret-0123")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = check(EXAMPLE, **example_env(), KVROUTE_REDIS_URL="redis+sentinel://127.0.0.1:26379/m")
    line = next(ln for ln in bad.stdout.splitlines() if "kvroute.redis_url:" in ln)
    assert bad.returncode == 2 and "Redis Sentinel is not supported" in line
