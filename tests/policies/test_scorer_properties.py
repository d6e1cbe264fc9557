"""What ``cache_aware``'s fast picker relies on in every scorer (``policies/scorers.py``), for any inputs.

1. A scorer reads nothing of ``Candidate.backend`` or ``view.last_pick`` (classes share one Candidate).
2. Only ``RESIDENT_SCORERS`` read ``resident_tokens`` (the rest are shared by a class of backends).
3. For a given match, a backend with no load, no queue, no cache and unknown capacity scores lowest (the
   bound that lets non-holders go unscored, ``CacheAware._cold_cannot_win``).
A formula change that breaks one of these fails here, not silently in the picker.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies.cache_aware import _IDLE, RESIDENT_SCORERS, CacheAwareConfig
from kvroute.policies.load import SCORING_FIELDS, BackendLoad
from kvroute.policies.scorers import SCORERS, Candidate
from kvroute.policies.speed import EngineSpeed

SPEEDS = [EngineSpeed(), EngineSpeed(prefill_tok_s=900.0, attn_s=1e-7, step_s=0.05, decode_s_per_seq=1e-3,
                                     chunk_tokens=512, slots=4)]
pos = st.floats(0.0, 1e6, allow_nan=False)


@st.composite
def candidates(draw):
    prompt = draw(st.integers(1, 300_000))
    matched = draw(st.integers(0, prompt - 1))
    best = draw(st.integers(matched, prompt - 1))
    speed = draw(st.sampled_from(SPEEDS))
    view = BackendLoad(draw(st.integers(0, 600)), draw(st.integers(0, 10**6)), draw(pos), draw(st.integers(0, 600)),
                       draw(st.floats(0.0, 1.0)), draw(st.floats(-1e9, 1e9)))
    capacity = draw(st.sampled_from([0.0, 1e3, 5e5]))
    c = Candidate(draw(st.text(max_size=5)), prompt, matched, view, draw(st.floats(0.01, 100.0)), draw(pos),
                  draw(st.integers(0, 600)), draw(st.floats(0.0, 100.0)), draw(pos), capacity,
                  best, speed.prefill_s(prompt - matched, matched), speed.prefill_s(prompt - best, best),
                  draw(st.floats(0.0, 1e5)))
    return c, speed


@settings(max_examples=400, deadline=None)
@given(candidates(), st.text(max_size=5), st.floats(-1e9, 1e9), pos)
def test_scorers_ignore_backend_and_last_pick_and_only_resident_scorers_read_the_cache(pair, name, last, res):
    c, speed = pair
    renamed = dataclasses.replace(c, backend=name, view=dataclasses.replace(c.view, last_pick=last))
    for f in SCORERS.values():
        assert f(renamed, speed) == f(c, speed)
    other = dataclasses.replace(c, resident_tokens=res)
    for n, f in SCORERS.items():
        if n not in RESIDENT_SCORERS:
            assert f(other, speed) == f(c, speed), n


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(candidates())
def test_an_idle_backend_with_no_cache_and_unknown_capacity_scores_lowest(pair):
    c, speed = pair
    idle = Candidate("", c.prompt, c.matched, _IDLE, c.factor, 0.0, 0, 0.0, 0.0, 0.0, c.best_matched, c.own_s,
                     c.best_own_s, c.output_tokens, c.reserved, c.evicts)
    for n, f in SCORERS.items():
        assert f(idle, speed) <= f(c, speed), n


def test_scoring_fields_are_the_views_fields_but_last_pick_then_the_trackers():
    view_fields = [f.name for f in dataclasses.fields(BackendLoad) if f.name != "last_pick"]
    assert list(SCORING_FIELDS) == [*view_fields, "work_s", "queued", "decode_s"]
    assert dataclasses.astuple(_IDLE)[:-1] == (0, 0, 0.0, 0, 0.0)
    # every Candidate input the picker fills is either request-level or in the class key
    request_level = {"backend", "prompt", "matched", "view", "factor", "resident_tokens", "capacity_tokens",
                     "best_matched", "own_s", "best_own_s", "output_tokens", "reserved", "evicts", "uncached"}
    assert {f.name for f in dataclasses.fields(Candidate)} == request_level | {"work_s", "queued", "decode_s"}
    assert CacheAwareConfig().max_scored >= 1
