"""The discrete-event loop both simulators share (``engine.simulate``, ``mixed_fleet.simulate_mixed``).

One event heap on a simulated clock (``now``), the replicas' step handling (plan a step when a replica is idle,
interrupt a running step when a request arrives, finish it and plan the next) and the engine-metrics scrape a
router sees every ``metrics_interval_s``. Callers add their own event kinds (``>= CALLER_KINDS``) and get the
replica steps back through ``on_step``; events that tie in time run in the order they were scheduled. With
``cores`` (``replica_llamacpp.SharedCores``: replicas sharing a host's cores), a step's end moves whenever another
replica starts or ends one; the loop reschedules every moved step after each plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from kvroute.policies import ExternalSignal, Router
from kvroute.sim.replica import Live, Replica

PLAN, END = 0, 1
#: The first event kind a caller may use.
CALLER_KINDS = 2

#: ``on_event(kind, x, ver, now)``: one caller event.
EventHandler = Callable[[int, int, int, float], None]
#: ``on_step(replica, first_tokens, done, now)``: a replica step ended.
StepHandler = Callable[[Replica, list[Live], list[Live], float], None]


class ReplicaLoop:
    """The event heap and the replicas' steps; ``now`` is the simulated time of the event being handled."""

    __slots__ = ("_index", "_interval", "_last_obs", "_plan_pending", "cores", "heap", "now", "replicas", "seq")

    def __init__(self, replicas: list[Any], metrics_interval_s: float | None, cores: Any = None) -> None:
        self.replicas = replicas
        self.cores = cores
        self._index = {id(r): i for i, r in enumerate(replicas)}
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self._plan_pending = [False] * len(replicas)
        self._interval = metrics_interval_s
        self._last_obs = -1e18

    def initial(self, at: float, kind: int, x: int) -> None:
        """An event known before the run (arrivals); the heap is built once when ``run`` starts."""
        self.heap.append((at, self.seq, kind, x, 0))
        self.seq += 1

    def schedule(self, at: float, kind: int, x: int, ver: int = 0) -> None:
        heapq.heappush(self.heap, (at, self.seq, kind, x, ver))
        self.seq += 1

    def admit(self, ri: int, live: Live, at: float) -> None:
        """Queue ``live`` on replica ``ri``: plan a step now if it is idle, else cut its step short if needed."""
        rep = self.replicas[ri]
        rep.enqueue(live)
        if rep.step is None:
            if not self._plan_pending[ri]:
                self._plan_pending[ri] = True
                self.schedule(at, PLAN, ri)
        elif rep.interrupt(at):
            self.schedule(rep.step.end, END, ri, rep.version)

    def scrape(self, router: Router, at: float) -> None:
        """Queue depth, running requests and KV usage of every replica, at most once per interval."""
        if self._interval is not None and at - self._last_obs >= self._interval:
            self._last_obs = at
            for rep in self.replicas:
                router.observe(rep.name, ExternalSignal(at=at, queue_depth=len(rep.waiting),
                                                        running=len(rep.admitted), kv_usage=rep.kv_usage()))

    def run(self, on_event: EventHandler, on_step: StepHandler,
            after_plan: Callable[[Replica, float], None] | None = None) -> float:
        """Handle events until none is left; returns the time of the last one. ``after_plan`` runs after a
        replica planned its next step (the precise index ships that replica's KV events there)."""
        heap = self.heap
        heapq.heapify(heap)
        pop, replicas, pending = heapq.heappop, self.replicas, self._plan_pending
        while heap:
            t, _, kind, x, ver = pop(heap)
            self.now = t
            if kind >= CALLER_KINDS:
                on_event(kind, x, ver, t)
                continue
            rep = replicas[x]
            if kind == PLAN:
                pending[x] = False
                if rep.step is not None:
                    continue
            else:
                if rep.step is None or ver != rep.version:
                    continue
                first, done = rep.finish(t)
                on_step(rep, first, done, t)
            step = rep.plan(t)
            if step is not None:
                self.schedule(step.end, END, x, rep.version)
            if self.cores is not None:  # steps whose end moved as this one started or ended
                for moved in self.cores.take_moved():
                    if moved is not rep and moved.step is not None:
                        self.schedule(moved.step.end, END, self._index[id(moved)], moved.version)
            if after_plan is not None:
                after_plan(rep, t)
        return self.now
