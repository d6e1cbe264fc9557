"""``kvroute demo``: the workload it replays, its figures, and one real run through the CLI with fake engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvroute.plugin.dev.demo import DemoOptions, render, replica_capacity_tokens
from kvroute.plugin.dev.demo_workload import PolicyReport, RequestResult
from kvroute.plugin.dev.workloads import WorkloadSpec, build_sessions
from kvroute.policies.errors import ConfigError

REPORT_KEYS = {"cached_token_share", "ttft_p50_s", "ttft_p90_s", "requests_per_s", "failed"}
POLICY_KEYS = REPORT_KEYS | {"wasted_prefill_tokens"}  # the last one from the proxy's metrics


def test_sessions_total_the_requested_count_and_share_prefixes():
    spec = WorkloadSpec(requests=50, turns=4, prefixes=6)
    sessions = build_sessions(spec)
    assert sum(len(s.turns) for s in sessions) == 50
    assert len(sessions) == 13 and spec.shared_prefixes == 6
    by_prefix: dict[int, set[str]] = {}
    for s in sessions:
        by_prefix.setdefault(s.system_id, set()).add(s.system)
    assert all(len(v) == 1 for v in by_prefix.values())  # one text per prefix id
    assert all(sum(1 for s in sessions if s.system_id == p) >= 2 for p in by_prefix)  # every prefix is shared
    assert build_sessions(spec) == sessions  # deterministic
    small = WorkloadSpec(requests=8, turns=4, prefixes=6)
    assert small.shared_prefixes == 1 and len(build_sessions(small)) == 2
    assert len(sessions[0].system) >= 4 * spec.prefix_tokens
    with pytest.raises(ConfigError, match="turns"):
        WorkloadSpec(turns=0)


def test_report_figures():
    report = PolicyReport(results=[RequestResult(ok=True, ttft_s=t, prompt_tokens=100, cached_tokens=c)
                                   for t, c in [(0.1, 0), (0.2, 50), (0.3, 100), (0.4, 90)]]
                          + [RequestResult(ok=False, error="APIError")], wall_s=2.0)
    d = report.as_dict()
    assert set(d) == REPORT_KEYS
    assert d["cached_token_share"] == 0.6 and d["failed"] == 1 and d["requests_per_s"] == 2.0
    assert d["ttft_p50_s"] == 0.2 and d["ttft_p90_s"] == 0.4
    assert PolicyReport().as_dict() == {"cached_token_share": 0.0, "ttft_p50_s": None, "ttft_p90_s": None,
                                        "requests_per_s": 0.0, "failed": 0}


def test_capacity_fits_own_share_of_prefixes_only():
    spec = WorkloadSpec(requests=48, prefixes=6, prefix_tokens=1000)
    cap = replica_capacity_tokens(spec, 3)
    assert 3 * 1000 <= cap < spec.shared_prefixes * 1000  # room for its 2 (+1), not for all 6
    assert DemoOptions(requests=10).spec().requests == 10


def test_render_table(capsys):
    from rich.console import Console

    fig = {"cached_token_share": 0.5, "ttft_p50_s": 0.1, "ttft_p90_s": None, "requests_per_s": 3.0, "failed": 0,
           "wasted_prefill_tokens": 0}
    render({"engine": "fake", "replicas": 3, "requests": 8,
            "policies": {"kvroute": fig, "round_robin": {**fig, "wasted_prefill_tokens": 12345}}}, Console(width=120))
    out = capsys.readouterr().out
    assert "cached-token share" in out and "50.0%" in out and "100 ms" in out
    assert "wasted prefill" in out and "12,345" in out


@pytest.mark.e2e
def test_demo_cli_json_with_fake_engines():
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    run = subprocess.run([sys.executable, "-m", "kvroute.plugin.cli.cli", "demo", "--engine", "fake", "--replicas", "2",
                          "--requests", "24", "--json"], capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert set(result) == {"engine", "replicas", "requests", "policies"}
    assert (result["engine"], result["replicas"], result["requests"]) == ("fake", 2, 24)
    assert set(result["policies"]) == {"kvroute", "round_robin"}
    kv, rr = result["policies"]["kvroute"], result["policies"]["round_robin"]
    assert set(kv) == set(rr) == POLICY_KEYS
    assert kv["failed"] == 0 and rr["failed"] == 0
    assert kv["cached_token_share"] > rr["cached_token_share"]
    assert kv["cached_token_share"] > 0.5
    assert 0 < kv["ttft_p50_s"] <= kv["ttft_p90_s"]
    assert rr["wasted_prefill_tokens"] > kv["wasted_prefill_tokens"] >= 0  # round robin recomputes held prefixes


def _descendants(root: int) -> set[int]:
    """PIDs whose parent chain leads to ``root`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_demo_ctrl_c_stops_every_process():
    import signal
    import time

    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "COLUMNS": "120"}
    demo = subprocess.Popen([sys.executable, "-m", "kvroute.plugin.cli.cli", "demo", "--engine", "fake",
                             "--replicas", "2", "--requests", "8"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        for line in demo.stderr:
            if "starting the LiteLLM proxy" in line:
                break
        children: set[int] = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(children) < 5:  # 2 × 2 replicas + the proxy
            children |= _descendants(demo.pid)
            time.sleep(0.2)
        assert len(children) >= 5, f"expected replicas and proxy under the demo, saw {children}"
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 130
        time.sleep(0.5)
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
