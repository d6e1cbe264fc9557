"""A do-nothing LiteLLM callback that reports, from inside the proxy, which of kvroute's stores grow.

``bench/soak.py --trace`` lists ``soak_trace.trace_callback`` among a proxy's callbacks (``bench/`` on
``PYTHONPATH``, ``SOAK_TRACE`` naming the report file). Every ``EVERY_S`` it writes (atomically) the size of every
container reachable from kvroute's callback (``census``: dicts, lists, sets, deques by attribute path, each with its
first and newest size) and, with ``SOAK_TRACEMALLOC=1`` (slow: keep the rate low), tracemalloc's top growth by
traceback since ``BASELINE_S`` after start-up.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import tracemalloc
from collections.abc import Mapping
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

FRAMES = 8
BASELINE_S = float(os.environ.get("SOAK_TRACE_BASELINE_S", "90"))
EVERY_S = 30.0
TOP = 25
DEPTH = 8
CONTAINERS = (dict, list, set, collections.deque, tuple)


def census(root: object, prefix: str = "cb", depth: int = DEPTH) -> dict[str, int]:
    """``{attribute path: len}`` of the containers reachable from ``root`` through kvroute objects' attributes
    (dicts and other mappings such as cachetools' caches, lists, sets, deques: only the first value of each is
    followed, so the walk stays cheap)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, left: int) -> None:
        if id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, (*CONTAINERS, Mapping)):  # a Mapping: cachetools' caches too
            if not isinstance(obj, tuple):
                out[path] = len(obj)
            first = next(iter(obj.values() if isinstance(obj, Mapping) else obj), None) if len(obj) else None
            if first is not None:
                walk(first, path + "[*]", left - 1)
            return
        if not type(obj).__module__.startswith("kvroute"):
            return
        fields = getattr(obj, "__dict__", None) or {s: getattr(obj, s, None) for s in _slots(type(obj))}
        for name, value in list(fields.items()):
            walk(value, f"{path}.{name}", left - 1)

    walk(root, prefix, depth)
    return out


def _slots(cls: type) -> list[str]:
    return [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())]


def growth(first: dict[str, int], now: dict[str, int]) -> list[tuple[str, int, int]]:
    """(path, first size, newest size) of the containers that grew, largest growth first."""
    rows = [(p, first.get(p, 0), n) for p, n in now.items() if n > first.get(p, 0)]
    return sorted(rows, key=lambda r: r[1] - r[2])


def tracemalloc_report(baseline: tracemalloc.Snapshot, now: tracemalloc.Snapshot) -> list[str]:
    """The ``TOP`` tracebacks whose live memory grew most since ``baseline``, innermost frame last."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib*")]
    stats = now.filter_traces(ignore).compare_to(baseline.filter_traces(ignore), "traceback")
    lines = [f"traced memory {sum(s.size_diff for s in stats) / 1e6:+.2f} MB since the baseline"]
    for s in stats[:TOP]:
        lines.append(f"{s.size_diff / 1e3:+.1f} KB in {s.count_diff:+d} blocks (now {s.size / 1e3:.1f} KB)")
        lines += [f"  {f.filename}:{f.lineno}" for f in s.traceback]
    return lines


def _callback() -> Any:
    from kvroute.plugin.adapter import litellm_hooks

    return litellm_hooks._instance


def _watch(path: str, trace: bool) -> None:
    started = time.monotonic()
    time.sleep(BASELINE_S)
    baseline = tracemalloc.take_snapshot() if trace else None
    first: dict[str, int] | None = None
    while True:
        cb = _callback()
        try:
            now = census(cb) if cb is not None else {}
        except RuntimeError:  # a container changed size under the walk: the next round reads it
            time.sleep(1.0)
            continue
        first = first if first is not None else now
        report: dict[str, Any] = {"seconds": round(time.monotonic() - started),
                                  "grew": [list(r) for r in growth(first, now)], "sizes": now}
        if baseline is not None:
            report["tracemalloc"] = tracemalloc_report(baseline, tracemalloc.take_snapshot())
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{path}.tmp", path)
        time.sleep(EVERY_S)


class TraceCallback(CustomLogger):
    """Starts the watcher once, in the process that loads it; hooks nothing."""

    def __init__(self) -> None:
        super().__init__()
        path = os.environ.get("SOAK_TRACE")
        if path:
            trace = os.environ.get("SOAK_TRACEMALLOC") == "1"
            if trace and not tracemalloc.is_tracing():
                tracemalloc.start(FRAMES)
            threading.Thread(target=_watch, args=(path, trace), name="soak-trace", daemon=True).start()


trace_callback = TraceCallback()
