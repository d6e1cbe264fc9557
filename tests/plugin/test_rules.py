"""Per-workload rules: first match wins over group, app and tag/metadata conditions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.plugin.adapter.request_labels import request_tags
from kvroute.plugin.adapter.rules import RuleBook
from kvroute.plugin.settings import RuleSettings
from kvroute.policies.errors import ConfigError


def book(*rules):
    return RuleBook.from_settings([RuleSettings(**r) for r in rules])


def test_first_matching_rule_wins():
    rb = book({"name": "batch", "match": {"tags": {"workload": "batch"}}, "policy": "least_load"},
              {"name": "agent", "match": {"group": "llama", "app": "agent"}, "policy": "session_affinity"},
              {"name": "llama", "match": {"group": "llama"}, "policy": "prefix_hash",
               "knobs": {"min_prefix_tokens": 64}})
    assert rb.resolve("llama", "agent", {"workload": "batch"}).name == "batch"
    assert rb.resolve("llama", "agent", {}).name == "agent"
    assert rb.resolve("llama", "other", {}).policy.name == "prefix_hash"
    assert rb.resolve("other", "agent", {}) is None
    assert len(rb) == 3


def test_bad_policy_names_rule_index():
    with pytest.raises(ConfigError) as err:
        book({"policy": "least_load"}, {"policy": "cache_aware", "knobs": {"nope": 1}})
    assert err.value.key == "kvroute.rules.1.knobs.nope"


def test_request_tags_from_metadata_and_tag_lists():
    meta = {"workload": "batch", "tags": ["team:search", "urgent"], "other": "x",
            "requester_metadata": {"workload": "ignored-first-wins", "tags": ["tier:gold"]}, "n": {"a": 1}}
    tags = request_tags(meta, ["workload", "tags", "n"], ["region:eu"])
    assert tags == {"workload": "batch", "team": "search", "urgent": "true", "tier": "gold", "region": "eu"}
    assert request_tags(None, ["workload"]) == {}


@given(st.dictionaries(st.sampled_from(["workload", "tier", "x"]), st.sampled_from(["a", "b"]), max_size=3),
       st.sampled_from([None, "app1", "app2"]))
def test_empty_rule_matches_everything_and_conditions_are_conjunctive(tags, app):
    rb = book({"name": "strict", "match": {"app": "app1", "tags": {"workload": "a"}}, "policy": "least_load"},
              {"name": "any", "policy": "round_robin"})
    hit = rb.resolve("g", app, tags)
    expected = "strict" if app == "app1" and tags.get("workload") == "a" else "any"
    assert hit is not None and hit.name == expected
