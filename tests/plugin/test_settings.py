"""Settings: env over the YAML ``kvroute:`` block; every bad value raises ConfigError naming its key."""

from __future__ import annotations

import pytest

from kvroute.plugin.settings import load_settings
from kvroute.policies.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_without_any_config():
    s = load_settings()
    assert s.default_policy == "cache_aware" and s.groups == {} and not s.billing_enabled


def test_block_read_from_proxy_config(tmp_path):
    path = write(tmp_path, """
model_list: []
kvroute:
  default_policy: least_load
  groups:
    llama: {policy: prefix_hash, knobs: {min_prefix_tokens: 128}}
    hosted: {kind: hosted}
  rules:
    - match: {tags: {workload: batch}}
      policy: least_load
""")
    s = load_settings(path)
    assert s.default_policy == "least_load"
    assert s.groups["llama"].knobs == {"min_prefix_tokens": 128}
    assert s.group("hosted").kind == "hosted"
    assert s.group("unknown").policy is None
    assert s.rules[0].match.tags == {"workload": "batch"}


def test_kvroute_config_env_wins_over_proxy_config(tmp_path, monkeypatch):
    own = tmp_path / "kv.yaml"
    own.write_text("kvroute: {default_policy: round_robin}\n")
    proxy = write(tmp_path, "kvroute: {default_policy: least_load}\n")
    monkeypatch.setenv("KVROUTE_CONFIG", str(own))
    assert load_settings(proxy).default_policy == "round_robin"


def test_env_overrides_yaml(tmp_path, monkeypatch):
    path = write(tmp_path, "kvroute: {metrics_port: 9100, redis_url: redis://a}\n")
    monkeypatch.setenv("KVROUTE_METRICS_PORT", "9200")
    monkeypatch.setenv("KVROUTE_BILLING_DB", "sqlite:///x.db")
    s = load_settings(path)
    assert s.metrics_port == 9200 and s.redis_url == "redis://a" and s.billing_enabled


@pytest.mark.parametrize(("text", "key"), [
    ("kvroute: {groups: {llama: {policy: nope}}}", "kvroute.groups.llama.policy"),
    ("kvroute: {groups: {llama: {policy: cache_aware, knobs: {bogus: 1}}}}", "kvroute.groups.llama.knobs.bogus"),
    ("kvroute: {groups: {llama: {polcy: x}}}", "kvroute.groups.llama.polcy"),
    ("kvroute: {rules: [{policy: least_load, match: {workload: x}}]}", "kvroute.rules.0.match.workload"),
    ("kvroute: {rules: [{policy: zzz}]}", "kvroute.rules.0.policy"),
    ("kvroute: {metrics_port: 70000}", "kvroute.metrics_port"),
    ("kvroute: {max_app_labels: 0}", "kvroute.max_app_labels"),
    ("kvroute: {groups: {g: {mode: exact}}}", "kvroute.groups.g.mode"),
    ("kvroute: {unknown_key: 1}", "kvroute.unknown_key"),
    ("kvroute: [1, 2]", "kvroute"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    assert err.value.key == key


def test_bad_env_value_names_the_key(monkeypatch):
    monkeypatch.setenv("KVROUTE_METRICS_PORT", "ninety")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.key == "kvroute.metrics_port"


def test_invalid_yaml_and_missing_file(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_settings(write(tmp_path, "kvroute: {a: [}\n"))
    monkeypatch.setenv("KVROUTE_CONFIG", str(tmp_path / "absent.yaml"))
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.key == "KVROUTE_CONFIG"


# --- strict config: every unknown, misplaced or invalid key stops startup, named ----------
@pytest.mark.parametrize(("text", "key"), [
    ("kvroute: {groups: {llama: {knobs: {block_tokens: 64}}}}", "kvroute.groups.llama.knobs"),
    ("kvroute: {groups: {llama: {precise: {sources: []}}}}", "kvroute.groups.llama.precise"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {socket: x}}}}", "kvroute.groups.llama.precise.socket"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {}}}}", "kvroute.groups.llama.precise"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {tokenizer: /nonexistent/tok}}}}",
     "kvroute.groups.llama.precise.tokenizer"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {sources: [{endpoint: 'tcp://x:1', bnd: true}]}}}}",
     "kvroute.groups.llama.precise.sources[0].bnd"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {block_size: -4, metrics: {a: 'http://a'}}}}}",
     "kvroute.groups.llama.precise.block_size"),
    ("kvroute: {groups: {llama: {mode: precise, precise: {metrics: {a: 'http://a'}, tier_credit: {cpu: 2}}}}}",
     "kvroute.groups.llama.precise.tier_credit.cpu"),
    ("kvroute: {groups: {llama: {isolation: tenant}}}", "kvroute.groups.llama.isolation"),
    ("kvroute: {billing_db: 'mysql://u@h/db'}", "kvroute.billing_db"),
    ("kvroute: {billing_db: 'postgresql+nodriver://u@h/db'}", "kvroute.billing_db"),
    ("kvroute: {billing_db: 'oracle://u@h/db'}", "kvroute.billing_db"),
    ("kvroute: {breaker: {consecutive_fails: 3}}", "kvroute.breaker.consecutive_fails"),
    ("kvroute: {hash_secret: short}", "kvroute.hash_secret"),
    ("kvroute: {endpoint_auth: none}", "kvroute.endpoint_auth"),
    ("kvroute: {rules: [{policy: least_load, knobs: {nope: 1}}]}", "kvroute.rules.0.knobs.nope"),
    ("kvroute: {default_knobs: {nope: 1}}", "kvroute.default_knobs.nope"),
])
def test_strict_config_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    assert err.value.key == key
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "value", "key"), [
    ("KVROUTE_METRICS_PROT", "9100", "KVROUTE_METRICS_PROT"),
    ("KVROUTE_REDIS", "redis://x", "KVROUTE_REDIS"),
    ("KVROUTE_METRICS_PORT__X", "1", "KVROUTE_METRICS_PORT__X"),
    ("KVROUTE_BILLING_DB", "mysql://u@h/db", "kvroute.billing_db"),
    ("KVROUTE_GROUPS", '{"llama": {"knobs": {"a": 1}}}', "kvroute.groups.llama.knobs"),
    ("KVROUTE_ENDPOINT_AUTH", "nobody", "kvroute.endpoint_auth"),
])
def test_strict_env_names_the_variable(monkeypatch, name, value, key):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert err.value.key == key


def test_known_env_of_other_parts_is_accepted(monkeypatch, tmp_path):
    for name, value in (("KVROUTE_BILLING_SPOOL", str(tmp_path)), ("KVROUTE_BILLING_GRACE_HOURS", "1"),
                        ("KVROUTE_CACHE_DIR", str(tmp_path)), ("KVROUTE_TEST_REDIS_URL", "redis://x"),
                        ("KVROUTE_GROUPS__LLAMA__ISOLATION", "team")):
        monkeypatch.setenv(name, value)
    assert load_settings().group("llama").isolation == "team"


def test_valid_precise_block_and_isolation_load(tmp_path):
    s = load_settings(write(tmp_path, """
kvroute:
  groups:
    llama:
      mode: precise
      isolation: key
      precise: {sources: [{endpoint: "tcp://127.0.0.1:5557", backend: a}], block_size: 16}
"""))
    assert s.group("llama").isolation == "key" and s.group("other").isolation == "none"


def test_multiproc_dir_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert "not a directory" in err.value.message
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert load_settings().prometheus_multiproc_dir == tmp_path


APPS = {"acme": {"keys": ["sha256:" + "a" * 64]}, "beta": {"keys": ["sha256:" + "b" * 64]}}


@pytest.mark.parametrize(("over", "llama", "other", "default"), [
    ({}, "none", "none", "none"),                                               # one organisation: shared
    ({"apps": {"acme": APPS["acme"]}}, "none", "none", "none"),                  # one app: nothing to split
    ({"apps": APPS}, "app", "app", "app"),                                       # several apps: one space each
    ({"apps": APPS, "groups": {"llama": {"isolation": "none"}}}, "none", "app", "app"),  # a group opts out
    ({"apps": APPS, "isolation": "none"}, "none", "none", "none"),               # or every group
    ({"isolation": "team", "groups": {"llama": {"policy": "least_load"}}}, "team", "team", "team"),
])
def test_isolation_is_per_app_by_default_when_the_config_names_several_apps(over, llama, other, default):
    s = load_settings(**over)
    assert (s.group("llama").isolation, s.group("other").isolation, s.default_isolation) == (llama, other, default)
