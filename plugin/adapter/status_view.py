"""What ``kvroute status`` shows: breakers, in-flight, index and hash-key state, summed over live workers."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvroute.plugin.adapter import hybrid

if TYPE_CHECKING:
    from kvroute.plugin.adapter.callback_host import CallbackHost


def worker_status(cb: CallbackHost) -> dict[str, Any]:
    """This worker's own counters (the shared state publishes them so any worker can answer for all)."""
    return {"pending": sum(len(router.attempts) for router in list(cb.routers.values())),
            "errors": {name: router.errors for name, router in list(cb.routers.items())}}


def status(cb: CallbackHost, show_api_base: bool = False) -> dict[str, Any]:
    """Breaker and routing state for ``kvroute status`` (ids, numbers and states only; ``api_base`` only
    when asked). Breakers, in-flight and index are shared through Redis; pending and errors are summed over
    the workers that published theirs within the last heartbeat TTL."""
    now = cb.clock()
    backends = {}
    for b in cb.fleet.backends.values():
        router = cb.routers.get(b.group)
        backends[b.id] = {
            "group": b.group,
            "kind": b.kind,
            "provider": b.provider,
            "breaker": cb.health.state(b.id, now),
            "inflight": router.load.inflight(b.id) if router else 0,
            "index_blocks": router.index.blocks(b.id) if router else 0,
        }
        if show_api_base:
            backends[b.id]["api_base"] = b.api_base
    mine = worker_status(cb)
    peers = dict(getattr(cb.shared, "peer_status", None) or {}) if cb.shared is not None else {}
    pending = mine["pending"] + sum(int(p.get("pending", 0)) for p in peers.values())
    groups = {}
    for name, router in cb.routers.items():
        errors = router.errors + sum(int((p.get("errors") or {}).get(name, 0)) for p in peers.values())
        groups[name] = {"policy": router.policy_for(name).name, "errors": errors,
                        **hybrid.status_of(router.policy_for(name), now)}
    out = {"groups": groups, "backends": backends, "rules": [r.name for r in cb.rules.rules],
           "pending": pending, "workers": 1 + len(peers),
           "hash_key": {"keyed": bool(cb.chain and cb.chain.keyed), "source": cb.chain_source}}
    if cb.shared is not None:
        out["hash_key"]["fingerprint"] = cb.chain_fingerprint
        mismatch = list(getattr(cb.shared, "secret_mismatch", []))
        out["hash_key"]["disagreeing_workers"] = mismatch
        if mismatch:
            out["hash_key"]["warning"] = (f"{len(mismatch)} live worker(s) use another hash_secret: their "
                                          "prefixes never match here; give every instance the same secret")
        out["shared_state"] = shared_state_status(cb, peers)
    return out


def shared_state_status(cb: CallbackHost, peers: Mapping[str, Any]) -> dict[str, Any]:
    """The Redis link (stream entries applied, re-seeds after an emptied Redis, errors) and every live worker's
    replication lag (seconds), this one first; ``replication`` is this worker's, with recent percentiles."""
    shared = cb.shared
    mine = shared.replication() if hasattr(shared, "replication") else {}
    workers = {shared.worker_id: {**mine, "fingerprint": cb.chain_fingerprint, "cb": True}}
    for w, p in sorted(peers.items()):
        workers[w] = {**(p.get("replication") or {}), "fingerprint": p.get("fp")}
    with contextlib.suppress(Exception):
        cb.metrics.shared_state(len(getattr(shared, "secret_mismatch", [])), mine.get("lag_s"))
    stats = shared.stats() if hasattr(shared, "stats") else {}
    return {"connected": bool(getattr(shared, "connected", False)), "namespace": shared.config.namespace,
            "instances": len(workers), "workers": workers, "replication": mine,
            **{k: stats[k] for k in ("entries", "applied", "reseeds", "errors") if k in stats}}
