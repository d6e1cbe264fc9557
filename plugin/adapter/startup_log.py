"""The one line kvroute logs when the proxy loads it: groups, policies, modes, billing target, Redis, metrics.

``startup_line(callback)`` builds it from a set-up ``KvrouteCallback`` (ids, names and URLs without passwords;
never prompt text); ``log_startup(callback)`` logs it at INFO on ``kvroute.startup``, with a stderr handler of
its own when the process has configured no logging (the LiteLLM proxy configures only its own loggers).
"""

from __future__ import annotations

import logging
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("kvroute.startup")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _group(name: str, callback: Any) -> str:
    backends = callback.fleet.groups().get(name, [])
    router = callback.routers.get(name)
    configured = callback.settings.group(name).policy_knobs[0]
    policy = router.policy_for(name).name if router is not None else (configured or "?")
    mode = callback.settings.group(name).mode
    hosted = sum(1 for b in backends if not b.self_hosted)
    kinds = ", ".join(part for part in (f"{len(backends) - hosted} self-hosted" if len(backends) > hosted else "",
                                        f"{hosted} hosted" if hosted else "") if part)
    extra = "; metrics scraped" if name in callback.scrapers else ""
    extra += "; KV events" if name in callback.precise else ""
    return f"{name} ({policy}, {mode}, {kinds or 'no deployments yet'}{extra})"


def startup_line(callback: Any) -> str:
    """One line describing what a set-up callback routes and where it sends state, usage and metrics."""
    s = callback.settings
    names = sorted(set(callback.fleet.groups()) | set(callback.routers) | set(s.groups))
    groups = ", ".join(_group(n, callback) for n in names) or "none yet (learned on the first request)"
    target = getattr(callback, "billing_target", None)
    if target is None:
        billing = "off"
    else:
        from kvroute.plugin.adapter.billing_feed import describe_target

        where = describe_target(target[0], target[1])
        billing = where if callback.recorder is not None else f"NOT RECORDING (recorder failed to start: {where})"
    if not s.redis_url:
        redis = "off (state local to this worker)"
    else:
        redis = redact(s.redis_url) + (" (shared)" if callback.shared is not None else " (unreachable: local state)")
    metrics = ", ".join(callback.mounted) or "not mounted"
    if s.metrics_port is not None:
        metrics += f", {s.metrics_host}:{s.metrics_port}"
    rules = f"{len(s.rules)} rule(s)"
    return (f"kvroute ready: groups {groups}; default policy {s.default_policy}; {rules}; "
            f"{isolation(s, names)}; billing {billing}; redis {redis}; routes {metrics}")


def isolation(settings: Any, names: list[str]) -> str:
    """Whose prefixes may meet in a cache: ``isolation app (default: 2 apps)``, or per group where they differ."""
    chosen = {n: settings.group(n).isolation for n in names}
    default = settings.default_isolation
    others = ", ".join(f"{n} {v}" for n, v in sorted(chosen.items()) if v != default)
    return f"isolation {default} ({settings.isolation_reason()}" + (f"; {others})" if others else ")")


def log_startup(callback: Any) -> None:
    """Log ``startup_line(callback)``; never raises (a description must not stop the proxy)."""
    try:
        line = startup_line(callback)
    except Exception as exc:  # the line is informative only
        line = f"kvroute ready (startup summary unavailable: {type(exc).__name__})"
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.info("%s", line)
