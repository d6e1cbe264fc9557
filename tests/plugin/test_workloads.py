"""plugin/dev/workloads.py: the one home of the replayed conversations gives the requests the three old builders gave
(``plugin/dev/demo_workload.py``, ``bench/peers_workloads.py`` and ``bench/llamacpp_agent.py`` at aeb9f42)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from kvroute.plugin.dev import workloads
from kvroute.plugin.dev.workloads import WorkloadSpec, build_sessions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp_agent  # noqa: E402
import peers_workloads as peers  # noqa: E402

#: the old builders' outputs with this corpus (the stdlib's text differs between Pythons), digested
FIXED_CORPUS = " ".join(f"line {i}: x = route(request, {i}) # kv" for i in range(6000))
OLD = {
    "demo default": "0dc0215a47948e6b",
    "demo seed 7": "df2b9a8711687bb8",
    ("peers", "default", "demo"): "cca253224b4b0ab9", ("peers", "default", "apps"): "6b48828dc491dff4",
    ("peers", "default", "agent"): "338328ad7454fc92",
    ("peers", "quick", "demo"): "c4dccf862b6f51d9", ("peers", "quick", "apps"): "b7501dea30ae6531",
    ("peers", "quick", "agent"): "87a85644fbeba79e",
    ("peers", "llamacpp", "demo"): "36a2074bfbf5acca", ("peers", "llamacpp", "apps"): "e2db15755c8cb48c",
    ("peers", "llamacpp", "agent"): "11469f139365858f",
    "agent default": "2a877f52d439929a",
    "agent small": "ffe20656a8faacfb",
}
OLD_CAPACITY = {"default": 4032, "quick": 1664, "llamacpp": 2176}


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


@pytest.fixture
def fixed_corpus(monkeypatch):
    monkeypatch.setattr(workloads, "corpus", lambda: FIXED_CORPUS)


def test_demo_sessions_are_the_old_builders(fixed_corpus):
    for label, spec in (("demo default", WorkloadSpec()),
                        ("demo seed 7", WorkloadSpec(requests=50, turns=3, prefixes=4, prefix_tokens=256, seed=7))):
        sessions = build_sessions(spec)
        old_shape = [[int(c.conv_id), c.system_id, c.system, list(c.turns)] for c in sessions]
        assert digest(old_shape) == OLD[label], label


def test_peers_workloads_are_the_old_builders(fixed_corpus):
    for label, size in (("default", peers.Size()), ("quick", peers.Size.quick()), ("llamacpp", peers.Size.llamacpp())):
        capacity = peers.replica_capacity_tokens(size, 3)
        assert capacity == OLD_CAPACITY[label]
        for name in (n for n in peers.WORKLOADS if ("peers", label, n) in OLD):  # those the old builders made
            w = peers.build(name, size, capacity)
            old_shape = [w.name, w.concurrency, w.max_tokens,
                         [[f.conv_id, f.start_s, f.system, list(f.turns)] for f in w.flows]]
            assert digest(old_shape) == OLD[("peers", label, name)], (label, name)


def test_coding_agent_sessions_are_the_old_builders(fixed_corpus):
    for label, shape in (("agent default", llamacpp_agent.AgentShape()),
                         ("agent small", llamacpp_agent.AgentShape(sessions=4, turns=3, engine="fake"))):
        sessions = llamacpp_agent.build_sessions(shape)
        old_shape = [[c.system, c.turns[0], list(c.turns[1:])] for c in sessions]  # (tools, task, outputs)
        assert digest(old_shape) == OLD[label], label


def test_a_changed_builder_changes_the_digest(fixed_corpus):
    """The check can fail: one question's wording more and the demo's digest moves."""
    sessions = build_sessions(WorkloadSpec())
    shape = [[int(c.conv_id), c.system_id, c.system, list(c.turns)] for c in sessions]
    shape[0][3][0] += "?"
    assert digest(shape) != OLD["demo default"]


def test_builders_use_the_stdlib_corpus_by_default():
    workloads.corpus.cache_clear()
    assert len(workloads.corpus()) > 100_000
    sessions = build_sessions(WorkloadSpec(requests=8))
    assert sessions[0].system[-100:] in workloads.corpus()
