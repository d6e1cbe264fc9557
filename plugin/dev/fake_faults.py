"""Fault injection for the fake engine: the plan a replica follows, and the client calls that set it.

Modes: ``500``; ``429`` with ``Retry-After``; ``slow_first_token`` (``delay_s`` before the response starts);
``stall_first_token`` (a stream: headers and the role chunk at once, the first content chunk ``delay_s`` later);
``drop`` (connection reset before any response byte); ``cut`` (stream or body cut after ``cut_after_chunks``
chunks). A plan holds for ``count`` completion requests, or until cleared when ``count`` is None.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvroute.policies.errors import ConfigError

FAULT_MODES = ("500", "429", "slow_first_token", "stall_first_token", "drop", "cut")


@dataclass
class FaultPlan:
    """The injected fault: ``mode`` for the next ``remaining`` completion requests (None = until cleared)."""

    mode: str | None = None
    remaining: int | None = None
    retry_after_s: float = 1.0
    delay_s: float = 2.0
    cut_after_chunks: int = 2

    def take(self) -> FaultPlan | None:
        """A copy of the fault for the request arriving now (None: serve normally), consuming one use."""
        if self.mode is None:
            return None
        taken = replace(self)
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.mode, self.remaining = None, None
        return taken

    @classmethod
    def parse(cls, body: object) -> FaultPlan:
        if not isinstance(body, dict):
            raise ConfigError("fault", "body must be a JSON object")
        mode = body.get("mode")
        if mode in (None, "none", "clear"):
            return cls()
        mode = str(mode)
        if mode not in FAULT_MODES:
            raise ConfigError("fault.mode", f"unknown mode {mode!r}; expected one of {', '.join(FAULT_MODES)}")
        count = body.get("count")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count <= 0):
            raise ConfigError("fault.count", "must be a positive integer or null (until cleared)")
        plan = cls(mode=mode, remaining=count)
        for key, attr in (("retry_after", "retry_after_s"), ("delay_s", "delay_s")):
            if key in body:
                value = body[key]
                if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"fault.{key}", "must be a number >= 0")
                setattr(plan, attr, float(value))
        if "cut_after_chunks" in body:
            value = body["cut_after_chunks"]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError("fault.cut_after_chunks", "must be an integer >= 0")
            plan.cut_after_chunks = value
        return plan



def _admin(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1") + "/admin"


def inject_fault(base_url: str, mode: str, count: int | None = None, **params: float) -> dict:
    """Ask the replica at ``base_url`` to fail its next ``count`` completions (None: until cleared) with ``mode``.

    ``params``: ``retry_after`` (429), ``delay_s`` (slow_first_token, stall_first_token), ``cut_after_chunks`` (cut).
    """
    import httpx

    r = httpx.post(_admin(base_url) + "/fault",
                   json={"mode": mode, "count": count, **params}, timeout=5.0, trust_env=False)
    if r.status_code != 200:
        raise ConfigError("fault", r.json().get("error", {}).get("message", r.text))
    return r.json()["fault"]


def clear_fault(base_url: str) -> None:
    """Serve normally again."""
    import httpx

    httpx.delete(_admin(base_url) + "/fault", timeout=5.0, trust_env=False)


def engine_stats(base_url: str) -> dict:
    """The replica's ``/admin/stats`` (request and cached-token counters, fault state; never prompt text)."""
    import httpx

    return httpx.get(_admin(base_url) + "/stats", timeout=5.0, trust_env=False).json()


@dataclass(frozen=True)
class StallTail:
    """A hosted provider's heavy tail: ``share`` of streams wait for their first token after the stream started,
    a Pareto delay of scale ``scale_s`` and shape ``alpha`` (smaller: heavier), at most ``max_s``."""

    share: float
    scale_s: float = 0.4
    alpha: float = 1.2
    max_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1 or self.scale_s <= 0 or self.alpha <= 0 or self.max_s < self.scale_s:
            raise ConfigError("stall", "needs 0 <= share <= 1, scale > 0, alpha > 0 and max >= scale")

    def draw(self, rng: random.Random) -> float:
        """Seconds this stream's first token waits (0: no stall)."""
        if rng.random() >= self.share:
            return 0.0
        return min(self.max_s, self.scale_s * (1.0 - rng.random()) ** (-1.0 / self.alpha))

