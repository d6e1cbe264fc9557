"""Generators produce the anchors' exact parameters."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from kvroute.sim.workloads import (
    GENERATORS,
    LLMD_LADDER,
    chat,
    gsp,
    llmd_shared_prefix,
    prefix_ratio,
    prefix_repetition,
)


def test_gsp_defaults() -> None:
    w = gsp(64)
    assert len(w.requests) == 64 * 16
    assert {r.arrival for r in w.requests} == {0.0}
    assert {(r.prompt_tokens, r.output_tokens) for r in w.requests} == {(2048 + 128, 256)}
    groups = Counter(tuple(r.keys[:32]) for r in w.requests)  # 2048 / 64 = 32 shared blocks per group
    assert len(groups) == 64 and set(groups.values()) == {16}
    assert len({tuple(r.keys) for r in w.requests}) == 1024
    # shuffled: consecutive requests are not all from the same group
    assert len({r.app for r in w.requests[:16]}) > 4


def test_gsp_is_deterministic_and_rate_is_poisson() -> None:
    assert [r.keys for r in gsp(64, groups=4, prompts_per_group=3).requests] == \
        [r.keys for r in gsp(64, groups=4, prompts_per_group=3).requests]
    w = gsp(64, groups=8, prompts_per_group=50, rate=10.0)
    arr = [r.arrival for r in w.requests]
    assert arr == sorted(arr) and 400 / 10 * 0.7 < arr[-1] < 400 / 10 * 1.3


def test_llmd_ladder_exact_stages_and_cycling() -> None:
    w = llmd_shared_prefix(64)
    assert [s for s, _ in w.stages] == ["warmup"] + [f"{r:g}" for r, _ in LLMD_LADDER]
    assert sum(r * d for r, d in LLMD_LADDER) + 750 == 17_084
    assert abs(len(w.requests) - 17_084) < 17_084 * 0.03  # Poisson draw around the published N
    assert {(r.prompt_tokens, r.output_tokens) for r in w.requests} == {(7200, 1000)}
    # request i reuses prompt i mod 750
    assert all(w.requests[i].keys == w.requests[i + 750].keys for i in range(0, 2000, 37))
    assert len({tuple(r.keys[:93]) for r in w.requests}) == 150  # 6000 // 64 = 93 shared blocks per group
    assert w.first_pass == 750


def test_prefix_repetition_and_ratio() -> None:
    w = prefix_repetition(16)
    assert len(w.requests) == 1000
    assert len({tuple(r.keys[:16]) for r in w.requests}) == 10
    pr = prefix_ratio(64, ratio=0.5)
    assert len(pr.requests) == 200
    assert len({tuple(r.keys[:109]) for r in pr.requests}) <= 20  # 7000 // 64 = 109 prefix blocks
    assert sum(1 for r in pr.requests if r.follows is None) == 20  # concurrency 20 closed loop


def test_chat_turns_extend_the_previous_prompt() -> None:
    w = chat(64, users=3, turns=4)
    by_session: dict[str, list] = {}
    for r in w.requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert len(turns) == 4
        for a, b in itertools.pairwise(turns):
            assert b.keys[: len(a.keys)] == a.keys
            assert b.follows is not None


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_builds_small(name: str) -> None:
    small = {"gsp": {"groups": 2}, "llmd-ladder": {"scale": 0.01}, "prefix-repetition": {"num_prompts": 20},
             "prefix-ratio": {"requests": 10}, "chat": {"users": 2}, "rag": {"requests": 10},
             "agent": {"tasks": 2}, "unique": {"requests": 10}, "one-shared-prefix": {"requests": 10}}[name]
    w = GENERATORS[name](64, **small)
    assert w.requests and all(r.prompt_tokens >= len(r.keys) * 64 for r in w.requests)
    assert all(math.isfinite(r.arrival) for r in w.requests)


def test_one_shared_prefix_is_the_field_case() -> None:
    w = GENERATORS["one-shared-prefix"](64)
    assert w.name == "one-shared-prefix" and len(w.requests) == 400
    assert all(r.prompt_tokens == 2548 + 7252 for r in w.requests)
    shared = 2548 // 64
    assert len({tuple(r.keys[:shared]) for r in w.requests}) == 1
    assert len({tuple(r.keys[: shared + 1]) for r in w.requests}) == 400
    span = w.requests[-1].arrival - w.requests[0].arrival
    assert 400 / span == pytest.approx(3.0, rel=0.15)
