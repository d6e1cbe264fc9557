"""Which app a request belongs to: the one rule the ledger, metrics and routing rules share.

The app comes from the authenticated key: key metadata ``kvroute_app``, else the team id, else the key alias. A
client's claim (``kvroute_app`` or an operator-named claim key, in the requester's metadata, the ``x-kvroute-app``
header or the request metadata) counts only when the key's metadata lists it in ``kvroute_trusted_apps`` (or holds
``"*"``), or, with no key at all, when the caller is the operator's own code (the SDK: there is no proxy auth). In
the proxy an unauthenticated claim counts nowhere. A request nothing names is booked as ``unattributed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.billing.call_facts import as_dict as _dict
from kvroute.billing.call_facts import first_given as _first

APP_KEY = "kvroute_app"
TRUSTED_KEY = "kvroute_trusted_apps"
APP_HEADER = "x-kvroute-app"
UNATTRIBUTED = "unattributed"  # the ledger's app of a request that names none


def _claim(sources: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str | None:
    for src in sources:
        for key in keys:
            value = src.get(key)
            if isinstance(value, str) and value:
                return value
    return None


def app_of(meta: Mapping[str, Any], *, claim_keys: Sequence[str] = (), slo_meta: Mapping[str, Any] | None = None,
           operator_call: bool = False) -> str | None:
    """The app of the request whose metadata is ``meta`` (and logging metadata ``slo_meta``), None when nothing
    names one; ``operator_call``: there is no proxy auth (the SDK), so a claim without a key counts."""
    slo_meta = slo_meta or {}
    key_meta = {**_dict(meta.get("user_api_key_metadata")), **_dict(slo_meta.get("user_api_key_auth_metadata"))}
    from_key = _first(key_meta.get(APP_KEY),
                      slo_meta.get("user_api_key_team_id"), meta.get("user_api_key_team_id"),
                      slo_meta.get("user_api_key_alias"), meta.get("user_api_key_alias"))
    keys = (APP_KEY, *claim_keys)
    requester = _dict(slo_meta.get("requester_metadata")) or _dict(meta.get("requester_metadata"))
    headers = {str(k).lower(): v for src in (meta.get("headers"), slo_meta.get("requester_custom_headers"))
               for k, v in _dict(src).items()}
    claimed = _first(_claim((requester,), keys), _claim((headers,), (APP_HEADER,)), _claim((meta,), keys))
    if claimed is not None:
        trusted = key_meta.get(TRUSTED_KEY)
        if isinstance(trusted, str):
            trusted = [t.strip() for t in trusted.split(",")]
        authenticated = from_key is not None or slo_meta.get("user_api_key_hash") or meta.get("user_api_key_hash")
        if (isinstance(trusted, list) and ("*" in trusted or claimed in trusted)) or (
                not authenticated and operator_call):
            return claimed
    return str(from_key) if from_key is not None else None


@dataclass(frozen=True, slots=True)
class AppRule:
    """``app_of`` with a deployment's claim keys (``app_metadata_keys``) and whether its callers are the operator's
    own code (the SDK) or the proxy's clients."""

    claim_keys: tuple[str, ...] = ()
    operator_calls: bool = False

    def __call__(self, meta: Mapping[str, Any], slo_meta: Mapping[str, Any] | None = None) -> str | None:
        return app_of(meta, claim_keys=self.claim_keys, slo_meta=slo_meta, operator_call=self.operator_calls)
