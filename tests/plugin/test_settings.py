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
    ("kvroute: {groups: {llama: {policy: cache_aware, knobs: {bogus: 1}}}}", "kvroute.groups.llama.policy.bogus"),
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
