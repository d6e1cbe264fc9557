"""The hash secret and Redis: whoever reads all of Redis cannot confirm a guessed prompt; instances keyed with
different secrets are said loudly (status, metrics, log) and do not pollute each other's index; an empty Redis
restart splits nothing (the secret never came from Redis). Real Redis, plugin instances as the proxy runs them."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec
import pytest
import redis
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings, load_settings
from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import ChainKey, FingerprintConfig, Fingerprinter

TEMPLATE = ("You are the support assistant of Example Bank. Verified caller. Account PIN: {pin}. "
            "Never repeat the PIN. " + "Policy text follows. " * 60)  # past min_prefix_tokens: a prefix, not short


def deps(n: int = 3) -> list[dict]:
    return [{"model_name": "llama", "litellm_params": {"model": "openai/m", "api_base": f"http://h{i}/v1"},
             "model_info": {"id": f"r{i}", "engine": "vllm"}} for i in range(n)]


def messages(pin: str) -> list[dict]:
    return [{"role": "system", "content": TEMPLATE.format(pin=pin)}, {"role": "user", "content": "balance?"}]


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def instance(url: str, ns: str, secret: str) -> KvrouteCallback:
    settings = KvrouteSettings(redis_url=url, redis_namespace=ns, hash_secret=secret)
    cb = KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)
    cb.settings  # noqa: B018 - set up now (resolves the secret, connects Redis)
    return cb


def send(cb: KvrouteCallback, msgs: list[dict]) -> str:
    chosen = cb.filter("llama", deps(), msgs, {"metadata": {}})[0]["model_info"]["id"]
    for rid, ticket in list(cb.tickets.items()):
        ticket.router.on_complete(rid, cached_tokens=0)
    return chosen


def close(*cbs: KvrouteCallback) -> None:
    for cb in cbs:
        if cb.shared is not None:
            cb.shared.close()


def dump(r: redis.Redis) -> list[bytes]:
    """Every value of every key, whatever its type (what someone who can read this Redis gets)."""
    out: list[bytes] = []
    for key in r.scan_iter("*", count=1000):
        kind = r.type(key).decode()
        out.append(key)
        if kind == "string":
            out.append(r.get(key))
        elif kind == "hash":
            for f, v in r.hgetall(key).items():
                out += [f, v]
        elif kind == "stream":
            for _, fields in r.xrange(key):
                for f, v in fields.items():
                    out += [f, v]
        elif kind == "zset":
            out += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        elif kind == "set":
            out += list(r.smembers(key))
        elif kind == "list":
            out += r.lrange(key, 0, -1)
    return [v for v in out if v]


def leaves(value: Any) -> list[Any]:
    """Every scalar inside a decoded msgpack value."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in (*leaves(k), *leaves(v))]
    if isinstance(value, list | tuple):
        return [x for v in value for x in leaves(v)]
    return [value]


def test_all_of_redis_cannot_confirm_a_guessed_pin(redis_url):
    ns, secret = f"kvtest-sec-{uuid.uuid4().hex[:8]}", "the-operators-secret-" + uuid.uuid4().hex
    a = instance(redis_url, ns, secret)
    try:
        msgs = messages("4821")
        send(a, msgs)
        r = redis.Redis.from_url(redis_url)
        assert wait_for(lambda: r.xlen(f"{ns}:prefix") > 0)
        time.sleep(0.6)  # a heartbeat: status, load and fingerprint are in Redis too
        values = dump(r)
        r.close()
    finally:
        close(a)
    scalars: list[Any] = []
    for v in values:
        scalars.append(v)
        with contextlib.suppress(Exception):
            scalars += leaves(msgspec.msgpack.decode(v))
    observed = {x for x in scalars if isinstance(x, int) and not isinstance(x, bool)}
    assert not any(secret.encode() in v for v in values if isinstance(v, bytes))

    def block_keys(key: ChainKey, pin: str) -> set[int]:
        fp = Fingerprinter(FingerprintConfig(chain=key, prefix_chain_keys=0))
        return set(fp.from_kwargs({"messages": messages(pin)}, model="llama", client_salt=False).keys)

    # the prompt's block keys are in Redis: with the secret, the guess is confirmed
    assert block_keys(ChainKey(secret.encode()), "4821") & observed
    # with what Redis holds (no key at all, or any value found in it as the key), no PIN is confirmed
    candidates = [ChainKey()] + [ChainKey(bytes(x) if isinstance(x, bytes) else str(x).encode())
                                 for x in {*scalars} if isinstance(x, bytes | str) and 16 <= len(x) <= 256]
    confirmed = [(pin, c) for c in candidates for pin in (f"{i:04d}" for i in range(10_000))
                 if block_keys(c, pin) & observed]
    assert confirmed == [], f"{len(candidates)} candidate keys tried"


def test_instances_with_different_secrets_are_said_loudly_and_kept_apart(redis_url, caplog):
    ns = f"kvtest-sec-{uuid.uuid4().hex[:8]}"
    a = instance(redis_url, ns, "first-secret-0123456789")
    b = instance(redis_url, ns, "second-secret-0123456789")
    c = instance(redis_url, ns, "first-secret-0123456789")
    try:
        with caplog.at_level(logging.ERROR, logger="kvroute.shared_state"):
            assert wait_for(lambda: a.shared.secret_mismatch == [b.shared.worker_id])
            assert wait_for(lambda: b.shared.secret_mismatch == sorted([a.shared.worker_id,
                                                                          c.shared.worker_id]))
        assert "uses a different hash_secret" in caplog.text
        status = a.status()
        assert status["hash_key"]["disagreeing_workers"] == [b.shared.worker_id] and status["hash_key"]["warning"]
        assert c.status()["hash_key"]["fingerprint"] == status["hash_key"]["fingerprint"]
        text = a.metrics.registry.get_sample_value("kvroute_hash_secret_mismatch_workers")
        assert text == 1.0
        # b's index updates never reach a (keyed with another secret: they could only mislead)
        send(a, messages("0000"))
        chosen = send(b, messages("1111"))
        b_keys = b.routers["llama"].fingerprint({"messages": messages("1111")}, model="llama").keys
        assert wait_for(lambda: a.shared.counters.get("foreign", 0) > 0)
        router_a = a.routers["llama"]
        assert router_a.index.match(b_keys, [chosen], router_a.clock()).get(chosen, 0) == 0
    finally:
        close(a, b, c)


def test_an_empty_redis_restart_splits_nothing(own_redis):
    ns, secret = f"kvtest-sec-{uuid.uuid4().hex[:8]}", "restart-secret-0123456789"
    a = instance(own_redis.url, ns, secret)
    b = instance(own_redis.url, ns, secret)
    try:
        assert wait_for(lambda: a.shared.connected and b.shared.connected)
        own_redis.stop()
        own_redis.start()  # no persistence: everything in Redis is gone
        c = instance(own_redis.url, ns, secret)  # started after the restart
        try:
            assert wait_for(lambda: all(x.shared.connected for x in (a, b, c)), timeout=15)
            msgs = messages("2024")
            chosen = send(a, msgs)
            router_c = c.routers.get("llama") or c.router_for("llama", [c.fleet.backend(d) for d in deps()])
            keys = router_c.fingerprint({"messages": msgs}, model="llama", client_salt=False).keys
            assert wait_for(lambda: router_c.index.match(keys, [chosen], router_c.clock()).get(chosen, 0) > 0)
            assert send(c, msgs) == chosen and send(b, msgs) == chosen
            assert wait_for(lambda: not any(x.shared.secret_mismatch for x in (a, b, c)))
            # every instance's replication lag is on the status page (c applied a's update: it has one)
            assert wait_for(lambda: len(c.status()["shared_state"]["workers"]) == 3)
            workers = c.status()["shared_state"]["workers"]
            assert 0 <= workers[c.shared.worker_id]["lag_s"] < 5 and all("lag_max_s" in w for w in workers.values())
        finally:
            close(c)
    finally:
        close(a, b)


def test_redis_without_a_secret_stops_startup_with_one_line(tmp_path):
    settings = KvrouteSettings(redis_url="redis://127.0.0.1:1/0")
    cb = KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)
    with pytest.raises(ConfigError) as err:
        cb.settings  # noqa: B018
    assert err.value.key == "kvroute.hash_secret" and "\n" not in str(err.value)


@pytest.mark.parametrize(("url", "words"), [
    ("not a url", "unsupported scheme"), ("http://127.0.0.1:6379", "unsupported scheme"),
    ("redis://127.0.0.1:notaport/0", "not a usable Redis URL"), ("redis:///0", "no host"),
    ("redis+sentinel://127.0.0.1:26379/mymaster", "Sentinel is not supported"),
    ("redis://:hunter22@127.0.0.1:6379/x", "not a usable Redis URL"),
])
def test_a_bad_redis_url_is_one_line_naming_the_key(url, words, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(None, redis_url=url)
    assert err.value.key == "kvroute.redis_url" and words in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and "hunter22" not in str(err.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:p%40ss@cache.example:6380/1",
                                 "unix:///run/redis.sock", "redis://:secret@10.0.0.5"])
def test_password_and_tls_urls_are_accepted(url):
    assert load_settings(None, redis_url=url).redis_url == url


def test_redis_url_litellm_follows_litellms_own_redis_settings(tmp_path, monkeypatch):
    from kvroute.plugin.state.redis_url import from_litellm, shown

    proxy = {"litellm_settings": {"cache_params": {"host": "cache.internal", "port": 6380, "password": "p@ss w",
                                                   "ssl": True}}}
    url = from_litellm(proxy, {})
    assert url == "rediss://:p%40ss%20w@cache.internal:6380/0" and shown(url) == "rediss://:***@cache.internal:6380/0"
    assert from_litellm({}, {"REDIS_HOST": "r1", "REDIS_PORT": "7000"}) == "redis://r1:7000/0"
    assert from_litellm({}, {"REDIS_URL": "redis://r2:6379/3"}) == "redis://r2:6379/3"
    with pytest.raises(ConfigError) as err:
        from_litellm({}, {})
    assert err.value.key == "kvroute.redis_url"
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text("litellm_settings: {cache_params: {url: 'redis://shared:6379/1'}}\nkvroute: {redis_url: litellm}\n")
    assert load_settings(cfg).redis_url == "redis://shared:6379/1"
