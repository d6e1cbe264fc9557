"""The hedge race on fake streams: who answers, who is closed and booked as lost, what the hedger learns."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvroute.plugin.adapter.hedge import HedgeCall, hedged
from kvroute.policies.hedging import HedgeConfig, Hedger, HedgeRoute


def chunk(text: str | None) -> SimpleNamespace:
    return SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=text))])


class Stream:
    """A provider stream: a role chunk at once, the first content after ``first_s``, then the rest; records close."""

    def __init__(self, name: str, first_s: float, texts: tuple[str, ...] = ("a", "b")) -> None:
        self.name, self.first_s, self.texts = name, first_s, texts
        self.closed = False

    async def _gen(self):
        yield chunk(None)
        await asyncio.sleep(self.first_s)
        for t in self.texts:
            yield chunk(f"{self.name}:{t}")

    def __aiter__(self):
        self._it = self._gen()
        return self._it

    async def aclose(self) -> None:
        self.closed = True
        await self._it.aclose()


def race(primary: Stream, hedge: Stream | None, *, samples: int = 20, floor: float = 5.0,
         send_error: bool = False) -> tuple[HedgeCall, dict]:
    hedger = Hedger(HedgeConfig(min_samples=samples, min_delay_s=0.05, max_delay_s=0.05, floor=floor))
    clock = asyncio.get_running_loop().time
    for _ in range(samples):
        hedger.learn("a", 100, 0.01, now=clock())
    seen: dict = {"sent": [], "lost": [], "won": None}

    async def send(backend: str):
        seen["sent"].append(backend)
        if send_error or hedge is None:
            raise RuntimeError("no route")
        return hedge

    routes = [HedgeRoute("a", hosted=True, model="m"), HedgeRoute("b", hosted=True, model="m")]
    call = HedgeCall(hedger, routes[0], routes, 100, send, lambda b, n: seen["lost"].append((b, n)),
                     lambda b, s: seen.__setitem__("won", b), clock=clock, sent_at=clock())
    return call, seen


async def relay(stream: Stream, call: HedgeCall) -> list[str | None]:
    return [c.choices[0].delta.content async for c in hedged(stream, call)]


@pytest.mark.asyncio
async def test_a_prompt_primary_is_never_hedged_and_teaches_the_hedger():
    primary = Stream("a", 0.0)
    call, seen = race(primary, Stream("b", 0.0))
    assert await relay(primary, call) == [None, "a:a", "a:b"]
    assert seen["sent"] == [] and seen["lost"] == [] and seen["won"] == "a"
    assert call.hedger.budget.hedges == 0


@pytest.mark.asyncio
async def test_a_stalled_primary_is_raced_the_hedge_answers_and_the_primary_is_closed():
    primary, hedge = Stream("a", 5.0), Stream("b", 0.0)
    call, seen = race(primary, hedge)
    assert await relay(primary, call) == [None, "b:a", "b:b"]  # the hedge's role chunk, then its content
    assert seen["sent"] == ["b"] and seen["lost"] == [("a", 0)] and seen["won"] == "b"
    assert primary.closed and call.answered is hedge  # (the hedge was read to its end first)


@pytest.mark.asyncio
async def test_a_primary_that_answers_first_after_all_closes_the_hedge():
    primary, hedge = Stream("a", 0.1), Stream("b", 5.0)
    call, seen = race(primary, hedge)
    assert await relay(primary, call) == [None, "a:a", "a:b"]
    assert seen["sent"] == ["b"] and seen["lost"] == [("b", 0)] and hedge.closed and call.answered is primary


@pytest.mark.asyncio
async def test_no_hedge_without_samples_budget_or_a_route_that_starts():
    primary = Stream("a", 0.1)
    call, seen = race(primary, Stream("b", 0.0), samples=0)
    call.hedger.config = HedgeConfig(min_samples=5)  # none learned: the route's quantile is unknown
    assert await relay(primary, call) == [None, "a:a", "a:b"] and seen["sent"] == []
    primary = Stream("a", 0.1)
    call, seen = race(primary, Stream("b", 0.0), floor=0.0)  # the bucket is empty
    assert await relay(primary, call) == [None, "a:a", "a:b"] and seen["sent"] == []
    primary = Stream("a", 0.1)
    call, seen = race(primary, None, send_error=True)  # the hedge could not start: the primary carries on
    assert await relay(primary, call) == [None, "a:a", "a:b"] and seen["sent"] == ["b"] and seen["lost"] == []


@pytest.mark.asyncio
async def test_a_client_that_leaves_mid_race_leaves_no_hedge_stream_open():
    primary, hedge = Stream("a", 5.0), Stream("b", 5.0)
    call, seen = race(primary, hedge)
    relay_task = hedged(primary, call)
    pending = asyncio.ensure_future(relay_task.__anext__())  # nothing comes before a side has content
    await asyncio.sleep(0.2)  # past the delay: the hedge was sent, both are stalled
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await relay_task.aclose()
    assert seen["sent"] == ["b"] and hedge.closed


def test_a_bad_hedge_block_stops_start_up_naming_its_key():
    from kvroute.plugin.adapter.wiring import build_hedges
    from kvroute.plugin.settings import KvrouteSettings
    from kvroute.policies.errors import ConfigError

    settings = KvrouteSettings(groups={"hosted": {"policy": "marketplace", "hedge": {"budjet": "5%"}}})
    with pytest.raises(ConfigError) as err:
        build_hedges(SimpleNamespace(), settings)
    assert err.value.key == "kvroute.groups.hosted.hedge.budjet"
    assert build_hedges(SimpleNamespace(), KvrouteSettings()) is None  # no group hedges: nothing on the path
