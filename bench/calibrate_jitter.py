"""The calibration's repeat-to-repeat variation: what moves when llama.cpp runs the same flows again, measured, and
the simulator's requests moved the same way.

Two runs of one workload through one router send the same requests in the same order per flow; what differs is when
each reaches the router. A flow's next turn leaves the client the instant the turn before it ends, so its arrival
moves with how long that turn took, and a flow's first turn moves with the client's scheduling. Which request arrives
in between decides, on one-slot replicas, whether a turn finds its prompt (round robin most of all), so these few
milliseconds are what a model replaying one timeline leaves out.

``measure`` reads the per-request logs of a workload's repeats (``bench/peers.py``'s ``requests_log``: flow, turn,
``start_s``, ``end_s``, ``cached_tokens``) and pools, over every router:

- ``step_ms``: for a turn that follows another, how much longer or shorter the step from the previous turn's start to
  its own took than that step's median over the repeats; only where the previous turn did the same work in every
  repeat (the same cached tokens), so that a routing difference (a hit in one repeat, a miss in another) is not
  counted as noise: the model replays the routing itself;
- ``start_ms``: a flow's first turn's start against its median over the repeats (a flow that waits for another
  to end, under a concurrency limit, excepted: its start moved with that flow's steps, already counted).

``jittered`` gives one simulator repeat, and the fake engines' run the same, where llama.cpp has the variation: in
the engine. ``step_rel`` pools the same steps' deviations relative to their medians; each simulated request runs its
engine steps at one plus a drawn deviation times the model's time (``SimRequest.time_factor``), and each fake replica
times a request's prefill and decode so (``plugin/dev/fake_llamacpp.drawn``, the fleet's ``time_jitter``). A step
then varies both ways about the model's own, as llama.cpp's does about its median. Each first turn arrives a sample
of ``start_ms`` later (never before 0). The samples are drawn with replacement by a seeded generator (repeat ``n``:
seed ``n``; a fake replica's draw is seeded by the request's tokens, which each repeat salts anew). No figure is
fitted: the samples are the measured run's. (Moving a later turn by a sample of ``step_ms`` instead, as both models
did before, could only add: a turn cannot leave before the one it follows ends, so a negative sample moved little or
nothing, every step ran long by the mean of the positive samples and varied by half as much as measured.)

``turn_delays`` gives the fake run's client its part: it holds only a flow's first turn back, by a sample of
``start_ms``, seeded by the repeat and the flow, so it does not depend on the order the replay's flows ask in.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvroute.sim.workload import Workload as SimWorkload


@dataclass(frozen=True, slots=True)
class Jitter:
    """Measured deviations (ms) of a step between turns and of a flow's first start from their medians."""

    step_ms: tuple[float, ...] = ()
    start_ms: tuple[float, ...] = ()
    step_rel: tuple[float, ...] = ()  # the same steps' deviations over their medians (0.05: 5 % longer)

    def to_json(self) -> dict:
        return {"step_ms": list(self.step_ms), "start_ms": list(self.start_ms), "step_rel": list(self.step_rel)}

    @classmethod
    def from_json(cls, data: Mapping | None) -> Jitter:
        data = data or {}
        return cls(tuple(data.get("step_ms", ())), tuple(data.get("start_ms", ())), tuple(data.get("step_rel", ())))

    def summary(self) -> dict:
        """How wide the measured variation is: count, median and 10/90 % of |deviation| per kind (ms)."""
        out = {}
        for name, values in (("step_ms", self.step_ms), ("start_ms", self.start_ms)):
            mags = sorted(abs(v) for v in values)
            out[name] = {"n": len(mags),
                         **({"abs_p10": mags[len(mags) // 10], "abs_p50": statistics.median(mags),
                             "abs_p90": mags[min(len(mags) - 1, len(mags) * 9 // 10)]} if mags else {})}
        return out


def _deviations(values: Sequence[float]) -> list[float]:
    mid = statistics.median(values)
    return [round((v - mid) * 1000.0, 2) for v in values]


def _relative(values: Sequence[float]) -> list[float]:
    mid = statistics.median(values)
    return [round(v / mid - 1.0, 4) for v in values] if mid > 0 else []


def measure(runs: Mapping[str, Sequence[Mapping]], gated: frozenset[str] = frozenset()) -> Jitter:
    """Pool the deviations over ``runs`` (router → its repeats, each with a ``requests_log``; module docstring).
    A router with fewer than two logged repeats adds nothing. ``gated``: flows whose first turn waits for another
    flow to end (a concurrency limit): their first start carries that flow's steps, so it is no start sample."""
    steps: list[float] = []
    starts: list[float] = []
    rel: list[float] = []
    for repeats in runs.values():
        logs = [r.get("requests_log") for r in repeats]
        if len(logs) < 2 or any(not log for log in logs):
            continue
        by_request = [{(q["flow"], q["turn"]): q for q in log if q.get("ok", True)} for log in logs]
        for key in set.intersection(*(set(b) for b in by_request)):
            flow, turn = key
            if turn == 0:
                if flow in gated:
                    continue
                starts += _deviations([b[key]["start_s"] for b in by_request])
                continue
            prev = (flow, turn - 1)
            if not all(prev in b for b in by_request):
                continue
            if len({b[prev].get("cached_tokens") for b in by_request}) != 1:  # a routing difference, not noise
                continue
            step = [b[key]["start_s"] - b[prev]["start_s"] for b in by_request]
            steps += _deviations(step)
            rel += _relative(step)
    return Jitter(tuple(sorted(steps)), tuple(sorted(starts)), tuple(sorted(rel)))


def jittered(workload: SimWorkload, jitter: Jitter, seed: int) -> SimWorkload:
    """Repeat ``seed`` of ``workload``: each request's engine time times one plus a drawn relative deviation, each
    first turn later by a drawn start sample (module docstring), the rest as is."""
    rng = random.Random(seed)
    requests = []
    for req in workload.requests:
        factor = 1.0 + rng.choice(jitter.step_rel) if jitter.step_rel else req.time_factor
        if req.follows is not None:
            requests.append(replace(req, time_factor=factor))
        else:
            extra = rng.choice(jitter.start_ms) / 1000.0 if jitter.start_ms else 0.0
            requests.append(replace(req, arrival=max(0.0, req.arrival + extra), time_factor=factor))
    return replace(workload, requests=requests)


def turn_delays(jitter: Jitter, seed: int) -> Callable[[object, int], float]:
    """Repeat ``seed``'s extra wait (seconds) before turn ``n`` of a replayed flow: a first turn's drawn start
    sample (never negative), none for a later turn (the fake engines vary its step; module docstring)."""

    def delay(flow: object, n: int) -> float:
        if n or not jitter.start_ms:
            return 0.0
        rng = random.Random(f"{seed}:{getattr(flow, 'conv_id', flow)}:{n}")
        return max(0.0, rng.choice(jitter.start_ms)) / 1000.0

    return delay
