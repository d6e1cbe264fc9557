"""Fleet of replica processes: healthy start on free ports, crash/restart, and no orphans in any exit path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from kvroute.plugin.dev.child_processes import ChildStartError, live_children
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions, resolve_engine
from kvroute.policies.errors import ConfigError

pytestmark = pytest.mark.e2e


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie counts as gone (its parent, not us, has to reap it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def test_fake_fleet_serves_and_stops():
    with Fleet(2, engine="fake", options=ReplicaOptions(capacity_tokens=2048)) as fleet:
        assert len(set(fleet.base_urls)) == 2
        assert all(url.startswith("http://127.0.0.1:") for url in fleet.base_urls)
        for api_base in fleet.api_bases:
            assert httpx.get(api_base + "/models").json()["data"][0]["id"] == "fake-model"
        stats = httpx.get(fleet.base_urls[0] + "/admin/stats").json()
        assert stats["cache_capacity_tokens"] == 2048 and stats["name"] == "replica-0"
        pids = fleet.pids()
        assert set(pids) <= set(live_children())
        workdir = fleet.workdir
    assert _wait_gone(pids, 1.0) == []
    assert not set(pids) & set(live_children())
    assert not workdir.exists()


def test_kill_and_restart_one_replica():
    with Fleet(2, engine="fake") as fleet:
        victim = fleet.kill(0)
        assert not victim.alive() and victim.stopped
        with pytest.raises(httpx.TransportError):
            httpx.get(victim.base_url + "/health", timeout=2)
        fresh = fleet.restart(0)
        assert fresh.alive() and httpx.get(fresh.base_url + "/health").status_code == 200
        assert fleet.replicas[0] is fresh
        pids = fleet.pids()
    assert _wait_gone(pids, 1.0) == []


def test_start_failure_reports_log_and_leaves_nothing():
    before = set(live_children())
    with pytest.raises(ChildStartError, match="exited with code") as err:
        Fleet(2, engine="fake", options=ReplicaOptions(extra_args=("--no-such-flag",))).start()
    assert "--no-such-flag" in str(err.value)  # the child's own error, from its log
    assert set(live_children()) == before


def test_bad_engine_and_count_are_config_errors():
    with pytest.raises(ConfigError, match="engine"):
        resolve_engine("tgi")
    with pytest.raises(ConfigError, match="replicas"):
        Fleet(0, engine="fake")
    assert resolve_engine("fake") == "fake"
    assert resolve_engine("auto") in ("fake", "llamacpp")


PARENT = textwrap.dedent("""
    import sys, time
    from kvroute.plugin.dev.fleet import Fleet
    with Fleet(2, engine="fake") as fleet:
        print(" ".join(map(str, fleet.pids())), flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_no_orphans_when_the_parent_is_signalled(sig):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"parent printed {line!r}"
        assert all(not _gone(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(20)
        assert _wait_gone(pids) == [], f"replicas outlived their parent after signal {sig}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_fault_helpers_against_a_replica_process():
    from kvroute.plugin.dev.fake_faults import clear_fault, engine_stats, inject_fault

    with Fleet(1, engine="fake") as fleet:
        api = fleet.api_bases[0]
        assert inject_fault(api, "500", count=1)["mode"] == "500"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(api + "/chat/completions", json=body).status_code == 500
        inject_fault(api, "429", retry_after=3)
        assert httpx.post(api + "/chat/completions", json=body).headers["retry-after"] == "3"
        clear_fault(api)
        assert httpx.post(api + "/chat/completions", json=body).status_code == 200
        assert engine_stats(api)["faults"] == {"500": 1, "429": 1}
        with pytest.raises(ConfigError, match="mode"):
            inject_fault(api, "meltdown")
