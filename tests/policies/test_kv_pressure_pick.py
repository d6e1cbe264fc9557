"""A holder whose KV the running requests will fill is left for one with room, once outputs are learned."""

from __future__ import annotations

from kvroute.policies import ExternalSignal, Router, RouterConfig
from kvroute.policies.lifecycle import SUCCESS, RequestOutcome
from kvroute.policies.request import RoutingRequest

BACKENDS = ["a", "b"]
SHARED = list(range(1000, 1016))  # a 1,024-token prefix in 64-token blocks


def request(rid: str, tail: int) -> RoutingRequest:
    keys = [*SHARED, 5000 + tail]
    return RoutingRequest("m", keys, 64, 64 * len(keys), request_id=rid)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def second_pick(output_tokens: int | None) -> tuple[str, str]:
    """(holder, where the next request sharing its prefix goes) when the holder's KV is 97 % used by 100 running
    requests and the other replica's half; the first request reported ``output_tokens`` when it completed."""
    clock = Clock()
    router = Router(RouterConfig(), clock=clock)
    first = request("r1", 1)
    holder = router.pick(first, BACKENDS).backend
    clock.t = 0.1
    router.on_first_token("r1")
    clock.t = 10.0
    router.finish(first, RequestOutcome(SUCCESS, holder, clock.t, cached_tokens=0, output_tokens=output_tokens))
    other = next(b for b in BACKENDS if b != holder)
    router.observe(holder, ExternalSignal(at=clock.t, running=100, kv_usage=0.97))
    router.observe(other, ExternalSignal(at=clock.t, running=100, kv_usage=0.5))
    return holder, router.pick(request("r2", 2), BACKENDS).backend


def test_a_holder_the_running_requests_will_fill_is_left_once_the_mean_output_is_known():
    holder, picked = second_pick(output_tokens=None)
    assert picked == holder  # the new tokens fit the 3 % free now: stay and reuse the prefix
    holder, picked = second_pick(output_tokens=1000)
    # 100 running requests halfway through 1,000-token outputs will add 50k tokens; the holder has 15k free
    assert picked != holder
