"""Workers sharing prefix index, load and breakers through a real redis-server; outages and catch-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from loopback import free_port

from kvroute.plugin.state.shared_state import SharedState, SharedStateConfig, connect
from kvroute.policies import Router
from kvroute.policies.health import BreakerConfig, BreakerState, Outcome

pytestmark = pytest.mark.e2e

BACKENDS = ["A", "B", "C", "D"]


def _config(**kw) -> SharedStateConfig:
    base = dict(namespace=f"kvtest-{uuid.uuid4().hex[:8]}", flush_interval_s=0.01, heartbeat_s=0.1,
                worker_ttl_s=1.0, backoff_min_s=0.05, backoff_max_s=0.3, socket_timeout_s=0.5,
                follower_grace_s=0.5)
    base.update(kw)
    return SharedStateConfig(**base)


@pytest.fixture
def workers() -> Iterator[Callable[..., tuple[SharedState, Router]]]:
    made: list[SharedState] = []

    def make(url: str, config: SharedStateConfig, name: str) -> tuple[SharedState, Router]:
        shared = connect(url, config, worker_id=name)
        made.append(shared)
        router = Router(index=shared.index("g"), load=shared.load("g"))
        return shared, router

    yield make
    for shared in made:
        shared.close()


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def chat(topic: str, turn: int = 0) -> dict:
    system = f"You are assistant {topic}. " + "Rules and context. " * 300
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": f"question {turn}"}]}


def test_two_workers_agree_on_prefix_and_load(redis_url, workers):
    cfg = _config()
    s1, r1 = workers(redis_url, cfg, "w1")
    s2, r2 = workers(redis_url, cfg, "w2")
    assert wait_until(lambda: s1.connected and s2.connected)
    req, d1 = r1.route(chat("alpha"), BACKENDS, request_id="a1")
    assert d1.backend is not None
    # Worker 2 learns where worker 1 sent the prefix and routes its follow-up there.
    assert wait_until(lambda: r2.index.match(req.keys, BACKENDS, time.monotonic()).get(d1.backend, 0) > 0)
    _, d2 = r2.route(chat("alpha", 1), BACKENDS, request_id="b1")
    assert d2.backend == d1.backend and d2.reason == "prefix_match"
    # In-flight load is summed across workers: worker 1's open requests count on worker 2.
    for i in range(3):
        r1.route(chat(f"load{i}"), [d1.backend], request_id=f"a-load-{i}")
    assert wait_until(lambda: r2.load.inflight(d1.backend) == 5)  # 1 (a1) + 3 here + 1 (b1) local
    assert r2.load.view(d1.backend, time.monotonic()).inflight == 5
    for rid in ("a1", "a-load-0", "a-load-1", "a-load-2"):
        r1.on_complete(rid, cached_tokens=0)
    assert wait_until(lambda: r2.load.inflight(d1.backend) == 1)
    # A failed request's blocks are forgotten everywhere.
    req3, d3 = r1.route(chat("gamma"), BACKENDS, request_id="a3")
    assert wait_until(lambda: r2.index.match(req3.keys, BACKENDS, time.monotonic()).get(d3.backend, 0) > 0)
    r1.on_failure("a3", before_prefill=True)
    assert wait_until(lambda: r2.index.match(req3.keys, BACKENDS, time.monotonic()).get(d3.backend, 0) == 0)


def test_breaker_transitions_reach_every_worker(redis_url, workers):
    cfg = _config()
    s1, _ = workers(redis_url, cfg, "w1")
    s2, _ = workers(redis_url, cfg, "w2")
    bcfg = BreakerConfig(jitter=0.0, consecutive_failures=2, base_cooldown_s=0.3)
    b1, b2 = s1.health_board(bcfg), s2.health_board(bcfg)
    assert wait_until(lambda: s1.connected and s2.connected)
    now = time.monotonic()
    b1.record("A", Outcome.PROVIDER_FAILURE, now)
    b1.record("A", Outcome.PROVIDER_FAILURE, now)
    assert b1.state("A") is BreakerState.OPEN
    assert wait_until(lambda: b2.state("A") is BreakerState.OPEN)
    assert not b2.available("A", time.monotonic())
    # The opener probes first (followers wait follower_grace_s longer); its success closes everywhere.
    assert wait_until(lambda: b1.allow("A", time.monotonic()), timeout=2)
    assert not b2.available("A", time.monotonic())
    b1.record("A", Outcome.SUCCESS, time.monotonic())
    assert b1.allow("A", time.monotonic())
    b1.record("A", Outcome.SUCCESS, time.monotonic())
    assert b1.state("A") is BreakerState.CLOSED
    assert wait_until(lambda: b2.state("A") is BreakerState.CLOSED)
    # Capacity (429 + Retry-After) spreads without a follower grace.
    b2.record("B", Outcome.CAPACITY, time.monotonic(), retry_after_s=1.0)
    assert wait_until(lambda: b1.state("B") is BreakerState.OPEN)
    snap = b1.snapshot(time.monotonic())["B"]
    assert snap["reason"] == "capacity" and snap["remaining_s"] <= 1.0


def test_late_joiner_catches_up(redis_url, workers):
    cfg = _config()
    s1, r1 = workers(redis_url, cfg, "w1")
    b1 = s1.health_board(BreakerConfig(jitter=0.0))
    assert wait_until(lambda: s1.connected)
    req, d = r1.route(chat("late"), BACKENDS, request_id="x")
    b1.record("C", Outcome.CONFIG_FAILURE, time.monotonic())
    assert wait_until(lambda: s1.stats()["outbox"] == 0)
    s2, r2 = workers(redis_url, cfg, "w2")
    b2 = s2.health_board(BreakerConfig(jitter=0.0))
    assert wait_until(lambda: r2.index.match(req.keys, BACKENDS, time.monotonic()).get(d.backend, 0) > 0)
    assert wait_until(lambda: b2.state("C") is BreakerState.OPEN)


def test_updates_for_a_group_not_yet_opened_are_kept(redis_url, workers):
    cfg = _config()
    s1, r1 = workers(redis_url, cfg, "w1")
    s2 = connect(redis_url, cfg, worker_id="w2")
    try:
        assert wait_until(lambda: s1.connected and s2.connected)
        req, d = r1.route(chat("pending"), BACKENDS, request_id="p")
        assert wait_until(lambda: s2.counters["applied"] == 0 and "g" in s2._pending)
        idx = s2.index("g")
        assert idx.match(req.keys, BACKENDS, time.monotonic()).get(d.backend, 0) == len(req.keys)
    finally:
        s2.close()


def test_redis_outage_routes_locally_and_converges(own_redis, workers):
    cfg = _config()
    s1, r1 = workers(own_redis.url, cfg, "w1")
    s2, r2 = workers(own_redis.url, cfg, "w2")
    assert wait_until(lambda: s1.connected and s2.connected)
    r1.route(chat("before"), ["A"], request_id="held")  # one in-flight request on A, seen by worker 2
    assert wait_until(lambda: r2.load.inflight("A") == 1)

    own_redis.stop()
    assert wait_until(lambda: not s1.connected and not s2.connected)
    # Routing goes on locally: no exception, sensible decisions, others' load stops counting.
    others = ["B", "C", "D"]
    req, d = r1.route(chat("during"), others, request_id="d1")
    assert d.backend in others and d.fallback is None
    r1.on_complete("d1", cached_tokens=0)  # the next turn follows the answer (a sibling racing it may spill)
    _, again = r1.route(chat("during", 2), others, request_id="d2")
    assert again.backend == d.backend and again.reason == "prefix_match"
    assert wait_until(lambda: r2.load.inflight("A") == 0, timeout=3)
    assert r2.index.match(req.keys, BACKENDS, time.monotonic()) == {}
    assert r1.errors == 0 and r2.errors == 0

    own_redis.start()  # same port, empty (no persistence)
    assert wait_until(lambda: s1.connected and s2.connected, timeout=10)
    # Worker 1's updates made during the outage reach worker 2; load converges again.
    assert wait_until(lambda: r2.index.match(req.keys, BACKENDS, time.monotonic()).get(d.backend, 0) > 0)
    assert wait_until(lambda: r2.load.inflight("A") == 1 and r2.load.inflight(d.backend) == 1)
    assert s1.counters["connects"] >= 2 and s1.counters["errors"] >= 1


def test_breakers_republished_after_redis_restart(own_redis, workers):
    cfg = _config()
    s1, _ = workers(own_redis.url, cfg, "w1")
    b1 = s1.health_board(BreakerConfig(jitter=0.0))
    assert wait_until(lambda: s1.connected)
    own_redis.stop()
    assert wait_until(lambda: not s1.connected)
    b1.record("D", Outcome.CONFIG_FAILURE, time.monotonic())  # opened while Redis was away
    own_redis.start()
    assert wait_until(lambda: s1.connected, timeout=10)
    s2, _ = workers(own_redis.url, cfg, "w2")
    b2 = s2.health_board(BreakerConfig(jitter=0.0))
    assert wait_until(lambda: b2.state("D") is BreakerState.OPEN)


def test_emptied_redis_is_reseeded_once_for_workers_that_start_after_it(own_redis, workers):
    cfg = _config()
    s1, r1 = workers(own_redis.url, cfg, "w1")
    s2, r2 = workers(own_redis.url, cfg, "w2")
    assert wait_until(lambda: s1.connected and s2.connected)
    req, d = r1.route(chat("before-restart"), BACKENDS, request_id="k")
    r1.on_complete("k", cached_tokens=0)
    assert wait_until(lambda: r2.index.match(req.keys, BACKENDS, time.monotonic()).get(d.backend, 0) == len(req.keys))
    assert s2.replication()["samples"] >= 1 and s2.replication()["lag_p50_s"] >= 0

    own_redis.stop()
    assert wait_until(lambda: not s1.connected and not s2.connected)
    own_redis.start()  # empty: the prefix stream and everything else are gone
    assert wait_until(lambda: s1.connected and s2.connected, timeout=10)
    assert wait_until(lambda: s1.stats()["outbox"] == 0 and s2.stats()["outbox"] == 0)
    assert s1.counters["reseeds"] + s2.counters["reseeds"] == 1  # one seeder, not one per worker
    s3, r3 = workers(own_redis.url, cfg, "w3")  # started after the restart
    assert wait_until(lambda: r3.index.match(req.keys, BACKENDS, time.monotonic()).get(d.backend, 0) == len(req.keys))
    assert s3.counters["reseeds"] == 0
    _, d3 = r3.route(chat("before-restart", 1), BACKENDS, request_id="k3")
    # It knows the holder: a match there, or the spill one router would also make (the fleet's busy seconds on
    # the holder exceed the idle fleet's hot-spot bound), never a cold pick.
    assert d3.reason in ("prefix_match", "prefix_spill")


def test_busy_seconds_are_the_fleets(redis_url, workers):
    cfg = _config()
    s1, r1 = workers(redis_url, cfg, "w1")
    s2, r2 = workers(redis_url, cfg, "w2")
    assert wait_until(lambda: s1.connected and s2.connected)
    _, d = r1.route(chat("busy"), BACKENDS, request_id="b1")
    now = time.monotonic()
    own = r1.load.busy(d.backend, now)
    assert own > 0 and r2.load.busy(d.backend, now) == 0
    assert wait_until(lambda: abs(r2.load.busy(d.backend, time.monotonic()) - own) < 0.01 * own)
    assert r2.load.busy_many(BACKENDS, time.monotonic())[BACKENDS.index(d.backend)] > 0.99 * own


def test_unreachable_redis_never_raises(workers):
    port = free_port()  # nothing listens here
    shared, router = workers(f"redis://127.0.0.1:{port}/0", _config(), "lonely")
    board = shared.health_board()
    for i in range(20):
        _, d = router.route(chat(f"t{i % 3}", i), BACKENDS, request_id=f"r{i}")
        assert d.backend in BACKENDS
        router.on_complete(f"r{i}", cached_tokens=100)
        board.record(d.backend, Outcome.SUCCESS, time.monotonic())
    assert wait_until(lambda: shared.counters["errors"] >= 1)
    assert not shared.connected and router.errors == 0


def test_dead_worker_load_expires(redis_url, workers):
    cfg = _config()
    s1, r1 = workers(redis_url, cfg, "w1")
    s2, r2 = workers(redis_url, cfg, "w2")
    assert wait_until(lambda: s1.connected and s2.connected)
    r1.route(chat("zombie"), ["B"], request_id="z")
    assert wait_until(lambda: r2.load.inflight("B") == 1)
    s1.close()  # the worker dies without completing its request
    assert wait_until(lambda: r2.load.inflight("B") == 0, timeout=4)


WORKER_SCRIPT = textwrap.dedent("""
    import sys, time
    from kvroute.plugin.state.shared_state import SharedStateConfig, connect
    from kvroute.policies import Router
    url, ns = sys.argv[1], sys.argv[2]
    cfg = SharedStateConfig(namespace=ns, flush_interval_s=0.01, heartbeat_s=0.1, worker_ttl_s=1.0)
    shared = connect(url, cfg, worker_id="proc")
    router = Router(index=shared.index("g"), load=shared.load("g"))
    system = "You are assistant proc. " + "Rules and context. " * 300
    kw = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    _, d = router.route(kw, ["C"], request_id="p1")
    print(d.backend, flush=True)
    sys.stdin.readline()
    shared.close()
""")


def test_second_process_is_seen(redis_url, workers):
    cfg = _config()
    _, r1 = workers(redis_url, cfg, "main")
    proc = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, redis_url, cfg.namespace],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "C"
        kw = {"model": "m", "messages": [{"role": "system", "content": "You are assistant proc. "
                                          + "Rules and context. " * 300}, {"role": "user", "content": "q2"}]}
        req = r1.fingerprint(kw, request_id="m1")
        assert wait_until(lambda: r1.index.match(req.keys, BACKENDS, time.monotonic()).get("C", 0) > 0)
        assert wait_until(lambda: r1.load.inflight("C") == 1)
        d = r1.pick(req, BACKENDS)  # C, or the spill away from it one router would make (C's busy seconds
        assert d.backend == "C" or d.reason == "prefix_spill"  # are the other process's too)
        assert r1.load.busy("C", time.monotonic()) > 0
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)


def _forked_worker(shared: SharedState, done) -> None:
    router = Router(index=shared.index("g"), load=shared.load("g"))
    router.route(chat("forked"), ["D"], request_id="f1")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (shared.connected and shared.stats()["outbox"] == 0
                                               and shared.counters["sent"] > 0):
        time.sleep(0.02)
    done.set()
    time.sleep(0.5)  # keep heartbeating a little so the parent sees the in-flight request
    shared.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_worker_gets_its_own_link(redis_url, workers):
    import multiprocessing

    cfg = _config()
    parent, router = workers(redis_url, cfg, "parent")
    assert wait_until(lambda: parent.connected)
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    child = ctx.Process(target=_forked_worker, args=(parent, done))
    child.start()
    try:
        assert done.wait(10)
        req = router.fingerprint(chat("forked", 1), request_id="m")
        assert wait_until(lambda: router.index.match(req.keys, BACKENDS, time.monotonic()).get("D", 0) > 0)
        assert wait_until(lambda: router.load.inflight("D") == 1)
        assert parent.worker_id == "parent"
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


def test_config_validation_and_bounded_queue():
    with pytest.raises(ValueError, match="heartbeat_s"):
        SharedStateConfig(heartbeat_s=0)
    with pytest.raises(ValueError, match="namespace"):
        SharedStateConfig(namespace="a b")
    shared = SharedState("redis://127.0.0.1:1/0", _config(max_outbox=10), worker_id="w", start=False)
    router = Router(index=shared.index("g"), load=shared.load("g"))
    for i in range(20):
        router.route(chat(f"q{i}"), BACKENDS, request_id=f"r{i}")
    stats = shared.stats()
    assert stats["outbox"] == 10 and stats["dropped"] == 10 and not stats["connected"]
    assert router.index.blocks() > 0  # local routing state is complete regardless


def test_a_forget_op_keeps_what_the_backend_held_and_an_older_workers_op_still_applies():
    from kvroute.plugin.state.shared_state import SharedPrefixIndex

    idx = SharedPrefixIndex(shared=None, group="g")  # type: ignore[arg-type]  # apply() reads no shared state
    keys = [11, 12, 13, 14]
    idx.local.record("b", keys, 0.0)
    idx.apply(("f", "b", keys, 2), 0.0)  # failed before prefill; the first two blocks were held already
    assert idx.local.match(keys, ["b"], 0.0) == {"b": 2}
    idx.local.record("b", keys, 0.0)
    idx.apply(("f", "b", keys[3:]), 0.0)  # a worker of the last release sends only the keys to drop
    assert idx.local.match(keys, ["b"], 0.0) == {"b": 3}
