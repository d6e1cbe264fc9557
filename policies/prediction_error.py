"""How far the self-hosted TTFT prediction runs behind reality: a rolling quantile of observed / predicted.

``record(request_id, ...)`` keeps a pick's prediction; ``observe(request_id, ttft_s, now)`` turns it into one
sample of observed / predicted; ``margin(now)`` is the ``quantile`` of the samples of the last ``window_s``
(1.0 with fewer than ``min_samples``, clamped to [1, ``max_margin``]). A policy that compares
``predicted × margin`` with a target keeps the share of misses near ``1 − quantile`` however the model errs.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque


class PredictionError:
    """Rolling observed/predicted TTFT ratios of self-hosted picks (plain floats, seconds)."""

    def __init__(self, quantile: float = 0.9, window_s: float = 120.0, *, min_samples: int = 20,
                 max_margin: float = 4.0, max_pending: int = 100_000, max_samples: int = 2048) -> None:
        if not 0 < quantile < 1:
            raise ValueError("prediction_quantile must be in (0, 1)")
        if not window_s > 0 or not max_margin >= 1:
            raise ValueError("prediction_window_s must be positive and max_margin >= 1")
        self.quantile = quantile
        self.window_s = window_s
        self.min_samples = max(1, int(min_samples))
        self.max_margin = max_margin
        self.max_pending = max_pending
        self._pending: OrderedDict[str, float] = OrderedDict()
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._cached: tuple[float, int, float] | None = None

    def record(self, request_id: str | None, predicted_s: float) -> None:
        """A self-hosted pick predicted ``predicted_s`` seconds to its first token."""
        if request_id is None or not (predicted_s > 0 and math.isfinite(predicted_s)):
            return
        self._pending[request_id] = predicted_s
        self._pending.move_to_end(request_id)
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def forget(self, request_id: str | None) -> None:
        if request_id is not None:
            self._pending.pop(request_id, None)

    def observe(self, request_id: str | None, ttft_s: float | None, now: float) -> None:
        """The pick's first token came after ``ttft_s`` seconds (a sample when its prediction is known)."""
        predicted = self._pending.pop(request_id, None) if request_id is not None else None
        if predicted is None or ttft_s is None or not (ttft_s >= 0 and math.isfinite(ttft_s)):
            return
        self._samples.append((now, ttft_s / predicted))
        self._cached = None

    def margin(self, now: float) -> float:
        """The window's ``quantile`` of observed / predicted, in [1, max_margin] (1.0 when too few samples)."""
        s = self._samples
        while s and s[0][0] < now - self.window_s:
            s.popleft()
            self._cached = None
        if len(s) < self.min_samples:
            return 1.0
        if self._cached is not None and self._cached[1] == len(s) and now - self._cached[0] < 1.0:
            return self._cached[2]
        ratios = sorted(r for _, r in s)
        k = min(len(ratios) - 1, max(0, math.ceil(self.quantile * len(ratios)) - 1))
        value = min(self.max_margin, max(1.0, ratios[k]))
        self._cached = (now, len(s), value)
        return value
