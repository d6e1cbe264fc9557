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


def test_the_fleet_tells_the_policy_which_backends_are_hosted_and_what_a_replica_token_costs():
    from kvroute.plugin import hybrid
    from kvroute.plugin.deployments import Backend

    policy = Router().set_policy("chat", "hybrid", {})
    fleet = [Backend("gpu-1", "chat", "m", "self_hosted", "vllm", input_price=Decimal("2e-7"),
                     output_price=Decimal("8e-7")),
             Backend("gpu-2", "chat", "m", "self_hosted", "vllm"),
             Backend("prov", "chat", "m", "hosted", "openai_compatible", input_price=Decimal("2e-6"),
                     output_price=Decimal("8e-6"))]
    hybrid.attach_fleet(policy, fleet)
    assert policy.is_hosted("prov") and not policy.is_hosted("gpu-1")
    rate = policy.self_rate("gpu-1")
    assert rate is not None and rate.price(1000, 10) == Decimal("2e-7") * 1000 + Decimal("8e-7") * 10
    assert policy.self_rate("gpu-2") is None  # unpriced replica, no default rate configured
    rule_policy = Router().set_policy("chat", "hybrid", {"ttft_target_s": 0.2})
    hybrid.share_group_state(rule_policy, policy)
    assert rule_policy.guard is policy.guard and rule_policy.market is policy.market
    assert hybrid.status_of(policy, 0.0)["hybrid"]["mode"] == "normal"
    assert hybrid.status_of(object(), 0.0) == {}
