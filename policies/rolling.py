"""Rolling windows for health and ranking: sliding success/failure counts and latency samples."""

from __future__ import annotations

import math
from collections import deque


class SlidingCounts:
    """Success/failure counts over a sliding window of fixed buckets."""

    __slots__ = ("_buckets", "bucket_s", "n")

    def __init__(self, window_s: float, buckets: int) -> None:
        self.bucket_s = window_s / buckets
        self.n = buckets
        self._buckets: deque[list[int]] = deque()  # [bucket index, successes, failures]

    def _trim(self, idx: int) -> None:
        b = self._buckets
        while b and (b[0][0] <= idx - self.n or b[0][0] > idx):
            b.popleft()

    def add(self, now: float, success: bool) -> None:
        idx = math.floor(now / self.bucket_s)
        self._trim(idx)
        b = self._buckets
        if not b or b[-1][0] != idx:
            b.append([idx, 0, 0])
        b[-1][1 if success else 2] += 1

    def totals(self, now: float) -> tuple[int, int]:
        idx = math.floor(now / self.bucket_s)
        s = f = 0
        for i, si, fi in self._buckets:
            if idx - self.n < i <= idx:
                s += si
                f += fi
        return s, f

    def clear(self) -> None:
        self._buckets.clear()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list (``q`` in [0, 1])."""
    if not values:
        return math.nan
    k = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[k]


class RollingLatency:
    """Recent samples (window, bounded) plus a baseline: the median of per-minute p90s, older than the window."""

    __slots__ = ("_baseline", "_minute", "_minute_vals", "_recent", "baseline_s", "window_s")

    def __init__(self, window_s: float = 300.0, baseline_s: float = 3600.0, max_samples: int = 512) -> None:
        self.window_s = window_s
        self.baseline_s = baseline_s
        self._recent: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._minute: int | None = None
        self._minute_vals: list[float] = []
        self._baseline: deque[tuple[int, float]] = deque(maxlen=max(2, int(baseline_s // 60) + 2))

    def add(self, now: float, value: float) -> None:
        if not (value >= 0 and math.isfinite(value)):
            return
        minute = math.floor(now / 60.0)
        if self._minute is not None and minute != self._minute and self._minute_vals:
            vals = sorted(self._minute_vals)
            self._baseline.append((self._minute, percentile(vals, 0.9)))
            self._minute_vals = []
        self._minute = minute
        if len(self._minute_vals) < 512:
            self._minute_vals.append(value)
        self._recent.append((now, value))

    def recent(self, now: float) -> list[float]:
        """Sorted samples from the last ``window_s``."""
        start = now - self.window_s
        return sorted(v for t, v in self._recent if start <= t <= now)

    def baseline(self, now: float) -> tuple[float | None, int]:
        """(median of per-minute p90s taken before the recent window and within ``baseline_s``, count)."""
        lo, hi = (now - self.baseline_s) / 60.0, (now - self.window_s) / 60.0
        pts = sorted(v for m, v in self._baseline if lo <= m and m + 1 <= hi)
        if not pts:
            return None, 0
        return percentile(pts, 0.5), len(pts)
