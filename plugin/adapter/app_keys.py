"""Apps on a proxy without LiteLLM's database: the ``kvroute.apps`` key map and the ``custom_auth`` that reads it.

```yaml
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  custom_auth: kvroute.plugin.adapter.app_keys.auth
kvroute:
  apps:
    acme: {keys: [os.environ/ACME_KEY]}                 # a key from the environment
    beta: {keys: ["sha256:9f86d081884c7d65..."]}        # or only its sha256 (printf %s "$KEY" | sha256sum)
```

``auth`` admits the master key as the proxy admin, a listed key as its app (key alias and key metadata
``kvroute_app``: what the one app rule of ledger, metrics and routing rules reads, ``billing.attribution``), and
refuses any other key with 401. Keys are kept and compared only as sha256 hashes; no key is ever logged.
"""

from __future__ import annotations

import hmac
from typing import Any

from kvroute.plugin.adapter.key_hashes import app_of


def _master_key() -> str | None:
    from litellm.proxy import proxy_server

    value = getattr(proxy_server, "master_key", None)
    return value if isinstance(value, str) and value else None


async def auth(request: Any, api_key: str) -> Any:
    """LiteLLM ``custom_auth``: the master key (admin), a key of ``kvroute.apps`` (its app), else 401."""
    from fastapi import HTTPException
    from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth

    from kvroute.plugin import kvroute_callback

    key = (api_key or "").removeprefix("Bearer ").strip()
    master = _master_key()
    if key and master and hmac.compare_digest(key.encode(), master.encode()):
        return UserAPIKeyAuth(api_key=key, user_role=LitellmUserRoles.PROXY_ADMIN)
    app = app_of(key, kvroute_callback.settings.app_keys) if key else None
    if app is None:
        raise HTTPException(status_code=401, detail="unknown API key (not the master key nor one of kvroute.apps)")
    return UserAPIKeyAuth(api_key=key, key_alias=app, metadata={"kvroute_app": app},
                          user_role=LitellmUserRoles.INTERNAL_USER)
