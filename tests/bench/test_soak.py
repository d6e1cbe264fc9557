"""``bench/soak.py``: its slope and verdict, the RSS it reads, its request mix, and one short real run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import soak  # noqa: E402

from kvroute.plugin.dev.child_processes import tree_rss_by_process, tree_rss_mib  # noqa: E402


def test_slope_is_least_squares_in_mb_per_ten_minutes():
    assert soak.slope_mb_per_10min([(t, 100 + 0.01 * t + (-1) ** t * 0.5) for t in range(0, 600, 5)]) == \
        pytest.approx(6.0, abs=0.1)
    assert soak.slope_mb_per_10min([(0, 1.0)]) is None and soak.slope_mb_per_10min([(3, 1.0), (3, 2.0)]) is None


def test_verdict_compares_kvroute_with_plain_within_the_tolerance():
    tol = soak.TOLERANCE_MB_PER_10MIN
    assert soak.verdict({"kvroute": {"slope_mb_per_10min": 5.0}, "plain": {"slope_mb_per_10min": 5.0 - tol}}) == "flat"
    assert soak.verdict({"kvroute": {"slope_mb_per_10min": 5.1}, "plain": {"slope_mb_per_10min": 5.0 - tol}}) == \
        "growing"
    assert soak.verdict({"kvroute": {"slope_mb_per_10min": 1.0}, "plain": {"slope_mb_per_10min": -9.0}}) == "flat"
    assert soak.verdict({"kvroute": {"slope_mb_per_10min": None}}) == "too short"


def test_a_proxy_that_dies_under_load_is_the_verdict_not_a_drop_to_zero_megabytes():
    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    dead.wait()
    arm = soak.Arm("kvroute", SimpleNamespace(process=dead), [])
    arm.samples = [(0.0, 450.0), (60.0, 540.0), (120.0, 545.0)]
    soak.take_sample(arm, 125.0)
    soak.take_sample(arm, 130.0)
    assert arm.samples[-1] == (120.0, 545.0) and arm.exited == (125.0, -11)
    rows = {"kvroute": soak.summary(arm, warmup_s=60), "plain": {"slope_mb_per_10min": 0.0, "exited": None}}
    assert rows["kvroute"]["rss_end_mb"] == 545.0 and rows["kvroute"]["exited"] == {"at_s": 125.0, "code": -11}
    assert soak.verdict(rows) == "died: kvroute at 125 s (exit -11)"


def test_tree_rss_counts_this_process_and_names_each_process_of_the_tree():
    assert tree_rss_mib(os.getpid()) > 1.0
    child = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # until the child has imported its module
            each = tree_rss_by_process(os.getpid())
            if f"{child.pid} http.server" in each and each[f"{child.pid} http.server"] > 5.0:
                break
            time.sleep(0.05)
        assert f"{child.pid} http.server" in each, each  # a ``python -m`` child is named by its module
        assert any(k.startswith(f"{os.getpid()} ") for k in each), each
        assert sum(each.values()) == pytest.approx(tree_rss_mib(os.getpid()), rel=0.2)
    finally:
        child.kill()
        child.wait()


def test_each_process_of_a_tree_gets_its_own_slope_after_warm_up():
    samples = [(t, {"1 litellm": 400 + 0.01 * t, "2 kvroute.billing.drain": 70.0}) for t in range(0, 1200, 5)]
    out = soak.per_process(samples, warmup_s=120)
    assert out["1 litellm"]["slope_mb_per_10min"] == pytest.approx(6.0)
    assert out["2 kvroute.billing.drain"] == {"rss_warmup_mb": 70.0, "rss_end_mb": 70.0, "slope_mb_per_10min": 0.0}


def test_the_mix_has_every_kind_shared_prefixes_one_offs_and_many_sessions():
    rng = random.Random(1)
    mix = [soak.request(i, rng) for i in range(400)]
    assert {kind for _, _, kind in mix} == {"whole", "stream", "cancel"}
    assert {body["model"] for body, _, _ in mix} == {"llama", "hosted"}
    systems = [b["messages"][0]["content"] for b, _, _ in mix if b["messages"][0]["role"] == "system"]
    assert len(systems) > 100 and len(set(systems)) == len(soak.SYSTEMS)
    assert len({h["x-session-id"] for _, h, _ in mix}) > 100


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_run_reports_every_figure(tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.4", "--warmup-minutes",
                           "0.1", "--sample-s", "1", "--rate", "2", "--replicas", "1", "--fault-every-s", "3",
                           "--no-plain", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"kvroute"} and result["verdict"] in ("flat", "growing")
    row = result["arms"]["kvroute"]
    assert row["rss_warmup_mb"] > 50 and row["rss_end_mb"] > 50 and row["slope_mb_per_10min"] is not None
    assert sum(row["outcomes"].values()) == result["requests_per_arm"] > 10
    assert len(result["samples"]["kvroute"]) >= 10 and "verdict:" in done.stdout
