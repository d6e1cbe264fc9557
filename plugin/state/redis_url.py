"""The Redis URL kvroute shares state through: checked up front, or taken from LiteLLM's own Redis settings.

Accepted: ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS; ``?ssl_cert_reqs=required`` and
``ssl_ca_certs=...`` as redis-py reads them) and ``unix:///path.sock``. Valkey speaks the same protocol
(``redis://``). Sentinel and Cluster URLs stop start-up with one line: kvroute's shared state uses multi-key
scripts and one connection per worker, which a Cluster splits across slots.

``redis_url: litellm`` uses the Redis the LiteLLM proxy is configured with, so one Redis serves both:
``litellm_settings.cache_params`` (``url``, or ``host``/``port``/``password``/``ssl``) in the proxy config, else
LiteLLM's environment variables ``REDIS_URL``, else ``REDIS_HOST``/``REDIS_PORT``/``REDIS_PASSWORD``/``REDIS_SSL``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

from kvroute.policies.errors import ConfigError

KEY = "kvroute.redis_url"
FROM_LITELLM = "litellm"
SCHEMES = ("redis", "rediss", "unix")
_UNSUPPORTED = {"redis+sentinel": "Sentinel", "rediss+sentinel": "Sentinel", "sentinel": "Sentinel",
                "redis+cluster": "Cluster", "rediss+cluster": "Cluster", "cluster": "Cluster"}


def check(url: str, key: str = KEY) -> str:
    """``url`` when redis-py can connect with it; else ``ConfigError`` naming ``key`` (no secret echoed)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(key, "empty Redis URL")
    try:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme in _UNSUPPORTED:
            raise ConfigError(key, f"Redis {_UNSUPPORTED[scheme]} is not supported: point it at one primary "
                                   "(redis:// or rediss://)")
        if scheme not in SCHEMES:
            raise ConfigError(key, f"unsupported scheme {parts.scheme or '(none)'!r}: use redis://, rediss:// "
                                   "or unix://")
        if scheme != "unix" and not parts.hostname:
            raise ConfigError(key, "no host in the Redis URL")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        db = parts.path.strip("/")
        if scheme != "unix" and db and not db.isdigit():
            raise ConfigError(key, f"not a usable Redis URL (database {db!r} is not a number)")
        from redis.connection import parse_url

        parse_url(url.strip())
    except ConfigError:
        raise
    except ImportError:
        raise ConfigError(key, "sharing state needs the redis package (pip install 'kvroute[redis]')") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, f"not a usable Redis URL ({_scrub(str(exc), url)})") from None
    return url.strip()


def shown(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and ``kvroute check``)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "(unparsable URL)"
    if not password:
        return url
    return url.replace(":" + password + "@", ":***@", 1)


def _scrub(message: str, url: str) -> str:
    """An error message without the URL's password."""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return message.replace(password, "***") if password else message


def from_litellm(proxy_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> str:
    """The URL of the Redis LiteLLM is configured with (see the module docstring); ``ConfigError`` when none."""
    params = ((proxy_config or {}).get("litellm_settings") or {}).get("cache_params") or {}
    if not isinstance(params, Mapping):
        params = {}
    if params.get("url"):
        return check(str(params["url"]), "litellm_settings.cache_params.url")
    if params.get("host"):
        return check(_build(params.get("host"), params.get("port"), params.get("password"),
                            params.get("ssl"), params.get("username")), "litellm_settings.cache_params.host")
    if environ.get("REDIS_URL"):
        return check(environ["REDIS_URL"], "REDIS_URL")
    if environ.get("REDIS_HOST"):
        return check(_build(environ["REDIS_HOST"], environ.get("REDIS_PORT"), environ.get("REDIS_PASSWORD"),
                            environ.get("REDIS_SSL"), environ.get("REDIS_USERNAME")), "REDIS_HOST")
    raise ConfigError(KEY, "'litellm' but LiteLLM has no Redis (litellm_settings.cache_params, REDIS_URL or "
                           "REDIS_HOST)")


def _build(host: Any, port: Any, password: Any, ssl: Any, username: Any = None) -> str:
    scheme = "rediss" if str(ssl).lower() in ("1", "true", "yes") else "redis"
    auth = ""
    if password:
        auth = f"{quote(str(username or ''), safe='')}:{quote(str(password), safe='')}@"
    return f"{scheme}://{auth}{host}:{port or 6379}/0"
