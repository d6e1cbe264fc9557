"""The ``hybrid:`` block of a group: strict like every other key, errors name the key, it builds the policy."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvroute.plugin.settings import load_settings
from kvroute.policies import Hybrid, Router
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


def test_hybrid_block_is_the_hybrid_policy_with_its_knobs(tmp_path):
    s = load_settings(write(tmp_path, """
kvroute:
  groups:
    chat:
      hybrid: {ttft_target_s: 0.8, max_overflow_share: 0.4, max_hosted_spend_per_hour: "12.50",
               app_targets: {voice: 0.3}, tag_targets: {"workload:batch": 30}}
"""))
    name, knobs = s.group("chat").policy_knobs
    assert name == "hybrid" and knobs["ttft_target_s"] == 0.8
    policy = Router().set_policy("chat", name, knobs)
    assert isinstance(policy, Hybrid) and policy.config.max_hosted_spend_per_hour == Decimal("12.50")
    assert policy.guard.max_share == 0.4


@pytest.mark.parametrize(("text", "key"), [
    ("chat: {hybrid: {ttft_target_s: -1}}", "kvroute.groups.chat.hybrid.ttft_target_s"),
    ("chat: {hybrid: {ttft_target: 1}}", "kvroute.groups.chat.hybrid.ttft_target"),
    ("chat: {hybrid: {max_overflow_share: 2}}", "kvroute.groups.chat.hybrid.max_overflow_share"),
    ("chat: {hybrid: {max_hosted_spend_per_hour: lots}}", "kvroute.groups.chat.hybrid.max_hosted_spend_per_hour"),
    ("chat: {hybrid: {}, policy: cache_aware}", "kvroute.groups.chat.hybrid"),
    ("chat: {hybrid: {}, kind: hosted}", "kvroute.groups.chat.kind"),
    ("chat: {hybrid: [1]}", "kvroute.groups.chat.hybrid"),
])
def test_bad_hybrid_blocks_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"kvroute:\n  groups:\n    {text}\n"))
    assert err.value.key == key or err.value.key.startswith(key), err.value
