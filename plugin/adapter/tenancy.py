"""Whose request it is: the tenant and engine salt (from the authenticated key only) and the app label of metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.plugin.settings import GroupSettings
from kvroute.policies import ChainKey

SALT_ENGINES = frozenset({"vllm"})  # engines that take a per-request ``cache_salt`` into their prefix cache
KEY_SALT_FLAG = "kvroute_cache_salt"  # key metadata: this key may send its own cache_salt
KEY_APP = "kvroute_app"  # key metadata: the app a key belongs to (isolation: app)


def tenant_salt(gs: GroupSettings, meta: Mapping[str, Any], kwargs: Mapping[str, Any],
                chain: ChainKey | None) -> tuple[str | None, str | None]:
    """The request's tenant under the group's ``isolation`` and the chain/engine salt, from the proxy's
    authenticated key data only (LiteLLM strips client-sent ``user_api_key_*`` metadata). A client's own
    ``cache_salt`` counts only when the key's metadata sets ``kvroute_cache_salt: true``; the salt sent to
    engines is a keyed digest, so one tenant cannot name another's."""
    key_meta = meta.get("user_api_key_metadata")
    key_meta = key_meta if isinstance(key_meta, Mapping) else {}
    parts: list[str] = []
    tenant = None
    if gs.isolation != "none":
        key = meta.get("user_api_key_hash")
        value = {"team": meta.get("user_api_key_team_id"), "key": key,
                 "app": key_meta.get(KEY_APP)}[gs.isolation]
        tenant = (f"{gs.isolation}:{value}" if value else f"key:{key}" if key else "anonymous")
        parts.append(tenant)
    if key_meta.get(KEY_SALT_FLAG) is True:
        client = client_salt(kwargs)
        if client:
            parts.append("client:" + client)
    if not parts:
        return tenant, None
    return tenant, "kvr-" + (chain or ChainKey()).digest("\x00".join(parts))


class AppNames:
    """The app label behind metrics and rules: the request's app by the one rule the ledger books it under
    (``kvroute.billing.attribution``, kept on its ``RequestState``), bounded per key (``max_apps_per_key``; more
    are counted as ``other``). The bound shapes metric labels only; the ledger books the app itself."""

    def __init__(self, max_apps_per_key: int) -> None:
        self.max_apps_per_key = max_apps_per_key
        self.seen: dict[str, set[str]] = {}

    def label(self, app: str | None, key_hash: Any) -> str | None:
        """``app`` as the label of a request sent with the key hashed ``key_hash`` (None: no app)."""
        if app is None:
            return None
        seen = self.seen.setdefault(str(key_hash or ""), set())
        if app not in seen:
            if len(seen) >= self.max_apps_per_key:
                return "other"
            seen.add(app)
        return app


def client_salt(kwargs: Mapping[str, Any]) -> str | None:
    """The ``cache_salt`` a client sent (top level or ``extra_body``), if any."""
    extra = kwargs.get("extra_body")
    value = kwargs.get("cache_salt") or (extra.get("cache_salt") if isinstance(extra, Mapping) else None)
    return str(value) if isinstance(value, str | int) and value != "" else None


def set_engine_salt(kwargs: dict, salt: str | None) -> dict | None:
    """Make the upstream request carry exactly ``salt`` as ``cache_salt`` (none when None): a client's own
    value never reaches an engine unchanged. Returns ``kwargs`` when it changed, else None."""
    extra = kwargs.get("extra_body")
    had = "cache_salt" in kwargs or (isinstance(extra, Mapping) and "cache_salt" in extra)
    if not had and salt is None:
        return None
    kwargs.pop("cache_salt", None)
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    extra.pop("cache_salt", None)
    if salt is not None:
        extra["cache_salt"] = salt
    if extra:
        kwargs["extra_body"] = extra
    else:
        kwargs.pop("extra_body", None)
    return kwargs
