"""A new scorer is a function and a line of configuration: registered by name, weighted by a group's knobs."""

from __future__ import annotations

import pytest
from test_policies import BACKENDS, group_prompt, make

from kvroute.policies import scorers
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.errors import ConfigError
from kvroute.policies.registry import build_policy
from kvroute.policies.scorers import SCORERS, Candidate
from kvroute.policies.speed import EngineSpeed


@pytest.fixture
def longer_prompts_elsewhere(monkeypatch: pytest.MonkeyPatch):
    """A toy scorer: 100 s for any backend that would recompute more than half the prompt."""
    monkeypatch.setattr(scorers, "SCORERS", dict(SCORERS))
    monkeypatch.setattr(scorers, "FLEET_SCORERS", set(scorers.FLEET_SCORERS))
    monkeypatch.setattr(scorers, "RESIDENT_SCORERS", set(scorers.RESIDENT_SCORERS))
    import kvroute.policies.cache_aware as cache_aware

    monkeypatch.setattr(cache_aware, "SCORERS", scorers.SCORERS)

    def mostly_cached(c: Candidate, speed: EngineSpeed) -> float:
        return 100.0 if c.uncached * 2 > c.prompt else 0.0

    scorers.register_scorer("mostly_cached", mostly_cached)
    return mostly_cached


def test_the_weight_knobs_and_the_scorers_map_are_one_set_of_weights():
    cfg = CacheAwareConfig(queue_weight=0.5, scorers={"kv": 2.0, "evict": 0.0})
    assert cfg.weights == {"queue": 0.5, "slot": 1.0, "prefill": 1.0, "kv": 2.0, "evict": 0.0, "others": 1.0}
    policy = CacheAware(cfg)
    assert [w for _, w in policy.fleet_scorers] == [1.0]  # evict weighed 0: left out
    with pytest.raises(ConfigError) as err:
        build_policy("cache_aware", {"scorers": {"queu": 1.0}}, where="groups.llama")
    assert err.value.key == "groups.llama.scorers" and "queue" in str(err.value)
    with pytest.raises(ConfigError):
        build_policy("cache_aware", {"scorers": {"queue": -1}})


def test_a_registered_scorer_is_off_until_a_group_weighs_it(longer_prompts_elsewhere):
    assert CacheAware(CacheAwareConfig()).config.weights["mostly_cached"] == 0.0
    with pytest.raises(ValueError, match="taken"):
        scorers.register_scorer("mostly_cached", longer_prompts_elsewhere)
    def next_pick(**knobs):
        router, _ = make(**knobs)
        req, dec = router.route(group_prompt(0, 0), BACKENDS)
        router.on_complete(req.request_id, cached_tokens=0)
        for i in range(6):  # the holder gets busy with other work
            router.route(group_prompt(1 + i, 0), [dec.backend])
        return dec.backend, router.route(group_prompt(0, 99), BACKENDS)[1]

    holder, plain = next_pick()
    assert plain.backend != holder  # as configured by default, the busy holder's queue sends it elsewhere
    holder, weighed = next_pick(scorers={"mostly_cached": 1.0})
    assert weighed.backend == holder  # recomputing most of the prompt now costs 100 s more than any queue
