"""kvroute's callback with each LiteLLM hook timed: the CPU its own thread spends inside the hook body.

``bench/proxy_cpu.py --hook-timers`` runs a proxy with ``litellm_settings.callbacks:
["proxy_hook_timers.timed_callback"]`` (``bench/`` on ``PYTHONPATH``, ``PROXY_HOOK_TIMERS`` naming a JSON file).
Every ``DUMP_EVERY`` calls of any hook the totals ``{hook: [calls, thread CPU seconds]}`` are written to that file
(atomically), so a reader divides the two for a mean that needs no exact call count. ``time.thread_time`` around
the ``await`` of a hook measures that hook alone while it never suspends: kvroute's hooks await only LiteLLM's other
filters and a precise group's tokenizer, and the bench's proxy has neither.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback, get_callback

DUMP_EVERY = 200
#: the hooks timed: every LiteLLM hook kvroute's callback overrides with a coroutine (not the stream iterator, an
#: async generator)
HOOKS = tuple(name for name, fn in vars(KvrouteCallback).items()
              if inspect.iscoroutinefunction(fn) and hasattr(CustomLogger, name))


def timed(callback: KvrouteCallback, path: str) -> KvrouteCallback:
    """``callback`` with each of ``HOOKS`` replaced on the instance by a timed wrapper writing to ``path`` (empty:
    nowhere)."""
    totals: dict[str, list[float]] = {}
    calls = [0]

    def dump() -> None:
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(totals, f)
        os.replace(tmp, path)

    def wrap(name: str, hook: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(hook)
        async def run(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return await hook(*args, **kwargs)
            finally:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.thread_time() - started
                calls[0] += 1
                if calls[0] % DUMP_EVERY == 0:
                    dump()
        return run

    for name in HOOKS:
        setattr(callback, name, wrap(name, getattr(callback, name)))
    return callback


timed_callback = timed(get_callback(), os.environ.get("PROXY_HOOK_TIMERS", ""))
