"""``requests_short``: how many requests stand between a policy's TTFT p90 and a target, checked by brute force."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvroute.sim.metrics import percentile, requests_short


def fewest_by_brute_force(values: list[float], q: float, target: float) -> int:
    """Try every set of values above ``target``, smallest sets first, each lowered to ``target``."""
    above = [i for i, v in enumerate(values) if v > target]
    for k in range(len(above) + 1):
        for chosen in itertools.combinations(above, k):
            changed = [target if i in chosen else v for i, v in enumerate(values)]
            if percentile(changed, q) <= target:
                return k
    raise AssertionError("lowering every value above the target always reaches it")


@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 20), st.sampled_from([50, 90, 99]))
def test_the_count_is_the_fewest_requests_whose_ttft_must_fall(values: list[int], target: int, q: int) -> None:
    xs = [float(v) for v in values]
    assert requests_short(sorted(xs), q, float(target)) == fewest_by_brute_force(xs, q, float(target))


def test_zero_when_the_target_is_met_and_none_without_requests() -> None:
    xs = sorted([0.1 * i for i in range(1, 101)])
    assert requests_short(xs, 90, percentile(xs, 90)) == 0
    assert requests_short([], 90, 1.0) is None
    assert requests_short(xs, 90, float("nan")) is None


def test_the_slowest_requests_come_down_first() -> None:
    # 10 values: p90 interpolates between the 9th and the 10th (2.0 + 0.1 * (3.0 - 2.0) = 2.1)
    xs = [1.0] * 8 + [2.0, 3.0]
    assert requests_short(xs, 90, 2.05) == 1  # the 10th at 2.05: 2.0 + 0.1 * 0.05 <= 2.05
    assert requests_short(xs, 90, 1.5) == 2  # with the 10th down, the 9th still pulls the p90 over 1.5
