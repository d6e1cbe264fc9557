"""Nothing outlives its attempt: after many attempts through the hooks (success, an answer before its success
event, a failed attempt then its retry, a superseded pick, a client gone away, an attempt never heard of again),
every store that holds an attempt is empty once the outcomes are in and the stale ones expired, and the
per-request store stays within its bound."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import litellm
from prometheus_client import CollectorRegistry

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings

MESSAGES = [{"role": "user", "content": "the shared system prompt " * 40 + "and a question"}]
BACKENDS = ("r-0", "r-1", "r-2")
MAX_REQUESTS = 40


def _deployment(backend: str) -> dict:
    return {"model_name": "llama",
            "litellm_params": {"model": "openai/fake-model", "api_base": f"http://10.0.0.{backend[-1]}:8000/v1",
                               "api_key": "x"},
            "model_info": {"id": backend}}


class _Traffic:
    """Drives one callback's hooks the way LiteLLM calls them, on a clock the test moves."""

    def __init__(self, tmp_path: Path, max_requests: int = 10_000) -> None:
        self.t = [1000.0]
        self.cb = KvrouteCallback(KvrouteSettings(data_dir=tmp_path / "d", billing_db="off", expire_every_s=1.0,
                                                  max_request_age_s=60.0),
                                  metrics=Metrics(CollectorRegistry()), mount=False, clock=lambda: self.t[0])
        self.cb._setup()
        self.cb.ids.max_requests = max_requests

    def pick(self, meta: dict) -> dict:
        """One pick and the upstream call's start: the call's kwargs."""
        self.t[0] += 0.01
        kwargs = {"model": "llama", "messages": MESSAGES, "metadata": meta}
        chosen = self.cb.filter("llama", [_deployment(b) for b in BACKENDS], MESSAGES, kwargs)
        call = {"model": "openai/fake-model", "model_info": {"id": chosen[0]["model_info"]["id"]}, "metadata": meta,
                "messages": MESSAGES}
        self.cb.pre_call(call)
        return call

    def succeed(self, call: dict) -> None:
        backend = call["model_info"]["id"]
        self.cb.on_success({"litellm_params": {"metadata": call["metadata"], "model_info": {"id": backend}},
                            "model": "fake-model", "standard_logging_object": {
                                "model": "fake-model", "model_id": backend, "model_group": "llama"}},
                           {"usage": {"prompt_tokens": 300, "completion_tokens": 2}}, None, None)

    def fail(self, call: dict) -> None:
        error = litellm.exceptions.APIConnectionError(message="Connection error.", llm_provider="openai",
                                                      model="fake-model")
        asyncio.run(self.cb.async_post_call_failure_deployment_hook(call, error, None))

    async def leave(self, call: dict) -> None:
        """The client reads one chunk of the stream and goes away (the proxy closes the hook's iterator)."""
        async def upstream():
            for _ in range(3):
                yield SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content="x"))], usage=None)

        stream = self.cb.async_post_call_streaming_iterator_hook(None, upstream(), call)
        await stream.__anext__()
        await stream.aclose()

    def serve(self, kind: str) -> None:
        meta: dict = {}
        call = self.pick(meta)
        if kind == "success":
            self.succeed(call)
        elif kind == "answered":
            asyncio.run(self.cb.async_post_call_success_deployment_hook(call, None, None))
            self.succeed(call)
        elif kind == "retried":
            self.fail(call)
            self.succeed(self.pick(meta))
        elif kind == "superseded":  # a fallback hop picks again before the first attempt's outcome
            self.succeed(self.pick(meta))
        elif kind == "cancelled":
            asyncio.run(self.leave(call))
        # "lost": no outcome ever comes; expiry must release it


def _open_counts(cb: KvrouteCallback) -> dict[str, int]:
    counts = {"awaiting": len(cb.ids.open_attempts())}
    for group, router in cb.routers.items():
        counts[f"{group}.attempts"] = len(router.attempts)
        counts[f"{group}.inflight"] = router.load.total_inflight(BACKENDS)
        counts[f"{group}.queued"] = sum(router.load.queued(b) for b in BACKENDS)
        counts[f"{group}.prefill"] = sum(router.load.prefill_tokens(b) for b in BACKENDS)
    return counts


def test_every_store_releases_its_attempts(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path)
    kinds = ("success", "answered", "retried", "superseded", "cancelled", "lost")
    for i in range(120):
        traffic.serve(kinds[i % len(kinds)])
    cb = traffic.cb
    router = cb.routers["llama"]
    lost = 120 // len(kinds)  # only the attempts never heard of again are open, still within their age
    counts = _open_counts(cb)
    assert counts.pop("llama.prefill") > 0
    assert counts == {"awaiting": lost, "llama.attempts": lost, "llama.inflight": lost, "llama.queued": lost}
    traffic.t[0] += 61.0  # past max_request_age_s: the next pick expires what never ended
    traffic.succeed(traffic.pick({}))
    assert _open_counts(cb) == {"awaiting": 0, "llama.attempts": 0, "llama.inflight": 0, "llama.queued": 0,
                                "llama.prefill": 0}
    assert not router._provisional


def test_the_request_store_is_bounded_and_evicting_a_request_ends_its_attempts(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path, max_requests=MAX_REQUESTS)
    for _ in range(3 * MAX_REQUESTS):
        traffic.serve("lost")
    cb, router = traffic.cb, traffic.cb.routers["llama"]
    assert len(cb.ids.requests) == MAX_REQUESTS
    assert len(cb.ids.open_attempts()) == len(router.attempts) == router.load.total_inflight(BACKENDS) == MAX_REQUESTS


def test_the_router_bounds_its_open_attempts(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path)
    traffic.pick({})
    router = traffic.cb.routers["llama"]
    router.config.max_pending = 5
    for _ in range(30):
        traffic.pick({})  # never finished, never expired: the oldest beyond the bound is released
    assert len(router.attempts) == 5 and router.load.total_inflight(BACKENDS) == 5


def test_the_plugins_attempt_holds_the_routers_record(tmp_path: Path) -> None:
    traffic = _Traffic(tmp_path)
    meta: dict = {}
    call = traffic.pick(meta)
    found = traffic.cb.ids.resolve(meta)
    assert found is not None
    attempt, router = found[1], traffic.cb.routers["llama"]
    assert attempt.routed is not None and attempt.routed is router.attempts.get(attempt.ticket)
    assert attempt.request is attempt.routed.request and attempt.routed.backend == call["model_info"]["id"]
    assert attempt.routed.charged
    traffic.succeed(call)
    assert router.attempts.get(attempt.ticket) is None and not attempt.routed.charged
