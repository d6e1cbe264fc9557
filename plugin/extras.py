"""kvroute's pip extras, the modules that prove each one is installed, and the error a command raises without it.

``require("proxy", "demo")`` raises ``MissingExtra`` ("kvroute demo needs the 'proxy' extra: pip install
'kvroute[proxy]'") when a module of the extra cannot be found; ``extra_for_module`` maps a failed import back to
the extra that provides it. Only ``importlib.util.find_spec`` is used: nothing is imported.
"""

from __future__ import annotations

import importlib.util

from kvroute.policies.errors import KvrouteError

# Import names (top level) each extra of pyproject.toml installs; the first ones are what kvroute itself imports.
EXTRAS: dict[str, tuple[str, ...]] = {
    "litellm": ("litellm", "openai"),
    "proxy": ("litellm", "openai", "fastapi", "uvicorn", "starlette", "websockets", "orjson", "backoff",
              "apscheduler", "jwt", "cryptography", "semver", "multipart", "expression", "fastapi_sso", "mcp",
              "soundfile", "litellm_enterprise", "litellm_proxy_extras"),
    "billing": ("sqlalchemy", "alembic", "psycopg", "polars", "jinja2"),
    "sim": ("matplotlib",),
    "events": ("zmq", "tokenizers", "jinja2"),
    "redis": ("redis",),
    "engines": ("xllamacpp", "gguf", "numpy", "safetensors"),
}
# A module some extras share is reported as the extra that needs it least (the smallest install).
_MODULE_EXTRA: dict[str, str] = {}
for _extra in ("engines", "proxy", "billing", "sim", "events", "redis", "litellm"):
    for _module in EXTRAS[_extra]:
        _MODULE_EXTRA[_module] = _extra
_MODULE_EXTRA.update({"uvloop": "proxy", "nacl": "proxy", "hiredis": "redis", "psycopg_binary": "billing"})


class MissingExtra(KvrouteError):
    """A command needs an optional dependency set (a pip extra) that is not installed."""

    def __init__(self, command: str, extra: str, module: str | None = None) -> None:
        super().__init__(f"kvroute {command} needs the '{extra}' extra: pip install 'kvroute[{extra}]'")
        self.command = command
        self.extra = extra
        self.module = module


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be found (empty when it is installed)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, command: str) -> None:
    """Raise ``MissingExtra`` naming ``command`` when ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtra(command, extra, missing[0])


def extra_for_module(name: str | None) -> str | None:
    """The extra that installs module ``name`` (dotted names count by their top level), or None."""
    if not name:
        return None
    return _MODULE_EXTRA.get(name.split(".", 1)[0])
