"""An OpenAI-compatible fake replica with a real prefix-cache model and fault injection, for tests and the demo.

Serves ``/v1/chat/completions`` and ``/v1/completions`` (JSON and SSE), ``/v1/models``, ``/health``, ``/metrics``
(vLLM- or llama.cpp-style names), vLLM's ``/tokenize``, ``/detokenize``, ``/v1/chat/completions/render`` and
``/v1/completions/render`` (``fake_tokens``), ``POST/DELETE /admin/fault``, ``GET /admin/stats`` and
``POST /admin/reset``.
Timing follows the work, as on a continuous-batching engine (calibrated to the llama.cpp CI preset,
``cpu-llamacpp-ci`` in ``sim/presets.py``): one compute queue per replica runs prefills in arrival order, each taking
``uncached / prefill_tokens_per_s · (1 + context_cost · (cached + uncached / 2))`` seconds (linear work plus
attention over the context), so concurrent misses delay each other and cache hits free the engine for
everyone. Decoding sequences share steps: a token takes ``decode_s_per_token · (1 + decode_batch_share · (n − 1))``
with ``n`` sequences decoding, and a step that shares its batch with a prefill chunk lasts as long as that
chunk. ``--engine-model llamacpp`` replaces that vLLM-style model with the bench's llama.cpp replica
(``fake_llamacpp``, the simulator's ``llamacpp`` preset): one slot, llama.cpp's host prompt cache of whole prompts
(``--cache-ram-mib``), token-granular reuse (the model's own tokens with ``--tokenizer``), the tiny model's step times,
with ``--host-cores`` the host's cores shared by the fleet's replicas, and with ``--time-jitter`` the run-to-run
variation of llama.cpp's times (each request's prefill and decode time, times one plus a deviation drawn for it,
taken or given at its prefill). The model's times are what a request
waits in all: the time this process spends reading, parsing and tokenizing a request is taken out of the model's
pre-slot time, and its cache update out of the prefill (otherwise a long prompt pays twice). Prompt text is never
logged or exposed.
Run it with ``python -m kvroute.plugin.dev.fake_engine --port 0 --capacity-tokens 8192``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field

import xxhash

from kvroute.plugin.dev.child_processes import write_ready_file
from kvroute.plugin.dev.fake_cache import BYTES_PER_TOKEN, PrefixCache, token_count
from kvroute.plugin.dev.fake_faults import FaultPlan, StallTail
from kvroute.plugin.dev.fake_http import ConnectionDropped, Exchange, Request, start_server
from kvroute.plugin.dev.fake_llamacpp import HostCores, LlamaCppModel, Seq, drawn
from kvroute.plugin.dev.fake_tokens import (
    TokenRequestError,
    detokenize_body,
    error_body,
    render_chat_body,
    render_completion_body,
    tokenize,
)
from kvroute.policies.errors import ConfigError
from kvroute.sim.presets import get_preset

log = logging.getLogger("kvroute.fake_engine")

_REDACTED_HEADERS = {"authorization", "api-key", "x-api-key", "cookie"}
_WORDS = [w.ljust(BYTES_PER_TOKEN)[:BYTES_PER_TOKEN] for w in
          ("the ", "kv ", "of ", "a ", "is ", "to ", "and ", "on ", "in ", "it ", "we ", "at ", "so ", "by ")]


@dataclass(frozen=True)
class FakeEngineConfig:
    """Knobs of one fake replica; times are seconds, speeds tokens per second."""

    name: str = "fake-0"
    model: str = "fake-model"
    capacity_tokens: int = 16384
    block_tokens: int = 16
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.002
    slots: int = 4
    # llama.cpp CI preset (7.4M model, 1 thread): cold 1013 tok 0.177 s, 4013 tok 1.42 s → t = a·n + b·n² with
    # a = 1.142e-4 s/token (8,760 tok/s) and b = 5.97e-8; attention relative to linear work: 2b/a per token
    context_cost: float = 1.045e-3
    chunk_tokens: int = 2048  # llama.cpp n_batch: a decode step sharing a batch with prefill waits this long
    decode_batch_share: float = 0.1
    default_max_tokens: int = 16
    max_tokens_limit: int = 4096  # larger requests get a 400 (one unbounded request once grew to 5 GB)
    metrics_style: str = "vllm"
    max_model_len: int = 131072  # what /tokenize reports; the fake engine enforces no context limit
    engine_model: str = "vllm"  # "llamacpp": the bench's llama.cpp replica (fake_llamacpp; one slot, not ``slots``)
    cache_ram_mib: float = 9.0  # llamacpp: the host prompt cache (--cache-ram)
    tokenizer: str | None = None  # llamacpp: a tokenizer.json to count tokens with (else tokens_per_byte)
    host_cores: float = 0.0  # llamacpp: cores of the host the fleet's replicas share (0: each its own)
    background_cores: float = 0.0  # of which other work keeps this many busy
    engine_cost: float = 1.0  # llamacpp: the host's slowness against the preset's (every compute time times this)
    cores_dir: str | None = None  # the directory the replicas sharing the host's cores meet in
    time_jitter: tuple[float, ...] = ()  # llamacpp: relative deviations of a request's time, one drawn a request
    stall: StallTail | None = None  # a heavy-tailed first-token stall of a share of streams (hosted providers)
    stall_seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity_tokens < 0:
            raise ConfigError("capacity_tokens", "must be >= 0")
        if self.block_tokens <= 0:
            raise ConfigError("block_tokens", "must be > 0")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError("prefill_tokens_per_s", "must be > 0")
        if self.decode_s_per_token < 0:
            raise ConfigError("decode_s_per_token", "must be >= 0")
        if self.slots <= 0:
            raise ConfigError("slots", "must be > 0")
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("max_tokens_limit", "must be >= default_max_tokens > 0")
        if self.context_cost < 0 or self.decode_batch_share < 0:
            raise ConfigError("context_cost", "context_cost and decode_batch_share must be >= 0")
        if self.chunk_tokens <= 0:
            raise ConfigError("chunk_tokens", "must be > 0")
        if self.metrics_style not in ("vllm", "llamacpp"):
            raise ConfigError("metrics_style", "must be 'vllm' or 'llamacpp'")
        if self.engine_model not in ("vllm", "llamacpp"):
            raise ConfigError("engine_model", "must be 'vllm' or 'llamacpp'")
        if self.host_cores < 0 or self.background_cores < 0 or self.cache_ram_mib < 0:
            raise ConfigError("host_cores", "host_cores, background_cores and cache_ram_mib must be >= 0")
        if not self.engine_cost > 0:
            raise ConfigError("engine_cost", "must be > 0")
        if any(not d > -1.0 for d in self.time_jitter) or (self.time_jitter and self.engine_model != "llamacpp"):
            raise ConfigError("time_jitter", "deviations must be > -1, with engine_model 'llamacpp'")
        if self.host_cores > 0 and (self.engine_model != "llamacpp" or not self.cores_dir):
            raise ConfigError("host_cores", "needs engine_model 'llamacpp' and a cores_dir")


@dataclass
class EngineStats:
    """Counters exposed by ``/admin/stats`` and ``/metrics``; holds header values and body keys, never text."""

    requests: int = 0
    completions: int = 0
    succeeded: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    stall_closes: list[float] = field(default_factory=list)  # wall times clients left a stalled stream (last 100)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    queue_seconds: float = 0.0  # simulated time prefills waited behind this replica's earlier prefills
    token_calls: dict[str, int] = field(default_factory=dict)  # /tokenize, /detokenize, render calls by path
    last_request: dict = field(default_factory=dict)


_TOKEN_ROUTES = {("POST", p) for p in ("/tokenize", "/detokenize", "/v1/chat/completions/render",
                                        "/v1/completions/render")}


class BadRequest(ValueError):
    """A request the OpenAI API would answer with 400."""


def render_chat(messages: object) -> str:
    """The prompt text a chat request becomes: ``<|role|>\\ncontent\\n`` per message, then the assistant tag."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = message.get("content") or ""
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest(f"messages[{i}].content: a text part's text must be a string")
            content = "".join(texts)
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        parts.append(f"<|{message['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    return prompt


def generate_text(prompt: str, n_tokens: int) -> str:
    """Deterministic output of exactly ``n_tokens`` fake tokens, chosen by a hash of the prompt."""
    seed = xxhash.xxh3_64_intdigest(prompt.encode("utf-8", "surrogatepass"))
    return "".join(_WORDS[((seed >> (i % 56)) ^ i) % len(_WORDS)] for i in range(n_tokens))


class FakeEngine:
    """The replica's state and request handling, independent of the socket layer."""

    def __init__(self, config: FakeEngineConfig) -> None:
        self.config = config
        self.llama = (LlamaCppModel(config.cache_ram_mib, config.tokenizer,
                                    get_preset("llamacpp").slower(config.engine_cost))
                      if config.engine_model == "llamacpp" else None)
        self.cache: PrefixCache | LlamaCppModel = self.llama or PrefixCache(config.capacity_tokens,
                                                                            config.block_tokens)
        self.cores = (HostCores(config.cores_dir, config.host_cores, config.name, config.background_cores)
                      if config.host_cores > 0 and config.cores_dir else None)
        self.fault = FaultPlan()
        self.stats = EngineStats()
        self._stall_rng = random.Random(config.stall_seed)
        self._slots = asyncio.Semaphore(1 if self.llama is not None else config.slots)  # the model: --parallel 1
        self.running = 0
        self.waiting = 0
        self.active_tokens = 0  # KV held by running requests (prompt + output), what vLLM calls "usage"
        self.decoding = 0
        self._compute_free_at = 0.0  # loop time when the prefill queued so far is done
        self.started_at = time.time()

    # ------------------------------------------------------------------ timing
    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """Compute time of a prefill of ``new_tokens`` after ``cached_tokens`` (alone on the engine)."""
        cfg = self.config
        return new_tokens / cfg.prefill_tokens_per_s * (1.0 + cfg.context_cost * (cached_tokens + new_tokens / 2))

    async def _prefill(self, seconds: float) -> None:
        """Queue ``seconds`` of prefill behind the prefills already queued on this replica and wait for it."""
        if self.cores is not None:  # one slot: nothing queued here; the host's cores are shared instead
            await self.cores.run(seconds)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.stats.queue_seconds += max(0.0, self._compute_free_at - now)
        done = max(now, self._compute_free_at) + seconds
        self._compute_free_at = done
        await asyncio.sleep(done - now)

    async def _decode_step(self, context: int) -> None:
        """Wait out one decode step (the llama.cpp model's at ``context`` tokens, on the shared cores if any)."""
        if self.llama is None:
            await asyncio.sleep(self._decode_step_s())
        elif self.cores is not None:
            await self.cores.run(self.llama.decode_s(context))
        else:
            await asyncio.sleep(self.llama.decode_s(context))

    def _decode_step_s(self) -> float:
        """One decode step now: shared with the other decoders, stretched by a prefill chunk running beside it."""
        cfg = self.config
        step = cfg.decode_s_per_token * (1.0 + cfg.decode_batch_share * max(0, self.decoding - 1))
        busy = self._compute_free_at - asyncio.get_running_loop().time()
        if busy > 0:
            step = max(step, min(busy, cfg.chunk_tokens / cfg.prefill_tokens_per_s))
        return step

    # ------------------------------------------------------------------ routing
    async def handle(self, request: Request, ex: Exchange) -> None:
        self.stats.requests += 1
        route = (request.method, request.path.rstrip("/") or "/")
        if route in (("POST", "/v1/chat/completions"), ("POST", "/chat/completions")):
            await self._completion(request, ex, chat=True)
        elif route in (("POST", "/v1/completions"), ("POST", "/completions")):
            await self._completion(request, ex, chat=False)
        elif route in (("GET", "/health"), ("GET", "/health/readiness")):
            await ex.send_json(200, {"status": "ok", "name": self.config.name})
        elif route in (("GET", "/v1/models"), ("GET", "/models")):
            await ex.send_json(200, {"object": "list", "data": [
                {"id": self.config.model, "object": "model", "created": int(self.started_at),
                 "owned_by": "kvroute-fake"}]})
        elif route in _TOKEN_ROUTES:
            await self._token_endpoint(request, ex)
        elif route == ("GET", "/metrics"):
            await ex.send(200, self.metrics_text().encode(), {"content-type": "text/plain; version=0.0.4"})
        elif route == ("POST", "/admin/fault"):
            await self._set_fault(request, ex)
        elif route == ("DELETE", "/admin/fault"):
            self.fault = FaultPlan()
            await ex.send_json(200, {"fault": None})
        elif route == ("GET", "/admin/stats"):
            await ex.send_json(200, self.stats_view())
        elif route == ("POST", "/admin/reset"):
            self.cache.clear()
            self.stats = EngineStats()
            await ex.send_json(200, {"reset": True})
        else:
            await ex.send_json(404, {"error": {"message": f"no route {request.method} {request.path}"}})

    async def _token_endpoint(self, request: Request, ex: Exchange) -> None:
        """vLLM's tokenizer endpoints (see ``fake_tokens``): no prefill, no cache change, counted by path."""
        path = request.path.rstrip("/")
        self.stats.token_calls[path] = self.stats.token_calls.get(path, 0) + 1
        try:
            body = request.json()
            if path == "/tokenize":
                answer: object = tokenize(body, render_chat, self.config.max_model_len)
            elif path == "/detokenize":
                answer = detokenize_body(body)
            elif path.endswith("/chat/completions/render"):
                answer = render_chat_body(body, render_chat, self.config.model)
            else:
                answer = render_completion_body(body, self.config.model)
        except (ValueError, RecursionError, TokenRequestError) as exc:
            await ex.send_json(400, error_body(str(exc)))
            return
        await ex.send_json(200, answer)

    async def _set_fault(self, request: Request, ex: Exchange) -> None:
        try:
            self.fault = FaultPlan.parse(request.json())
        except (ValueError, ConfigError) as exc:
            await ex.send_json(400, {"error": {"message": str(exc)}})
            return
        await ex.send_json(200, {"fault": asdict(self.fault)})

    def stats_view(self) -> dict:
        view = asdict(self.stats)
        view.update(name=self.config.name, running=self.running, waiting=self.waiting,
                    cache_used_tokens=self.cache.used_tokens, cache_capacity_tokens=self.cache.capacity_tokens,
                    cache_evicted_blocks=self.cache.evicted_blocks, fault=asdict(self.fault))
        return view

    # ------------------------------------------------------------------ completions
    async def _completion(self, request: Request, ex: Exchange, chat: bool) -> None:
        self.stats.completions += 1
        try:
            body = request.json()
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            prompt = render_chat(body.get("messages")) if chat else _prompt_text(body.get("prompt"))
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.config.default_max_tokens
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
                raise BadRequest("max_tokens must be a positive integer")
            if max_tokens > self.config.max_tokens_limit:
                raise BadRequest(f"max_tokens must be <= {self.config.max_tokens_limit}")
        except (ValueError, RecursionError, BadRequest) as exc:  # JSON nested too deep is a bad request too
            await ex.send_json(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
            return
        headers = {k: ("<redacted>" if k in _REDACTED_HEADERS else v) for k, v in request.headers.items()}
        self.stats.last_request = {"path": request.path, "headers": headers, "body_keys": sorted(body)}
        fault = self.fault.take()
        mode = fault.mode if fault else None
        if fault is not None:
            self.stats.faults[mode] = self.stats.faults.get(mode, 0) + 1
        if mode == "drop":
            ex.abort()
            return
        if mode == "500":
            await ex.send_json(500, {"error": {"message": "injected fault: internal server error",
                                               "type": "server_error", "code": 500}})
            return
        if mode == "429":
            await ex.send_json(429, {"error": {"message": "injected fault: rate limited", "type": "rate_limit_error",
                                               "code": 429}},
                               {"retry-after": f"{fault.retry_after_s:g}"})
            return
        seq = self.llama.encode(prompt) if self.llama is not None else None  # tokenized once, before any slot
        if self.llama is not None:  # HTTP, chat template and tokenizing hold no slot; what this process already
            # spent reading, parsing and tokenizing the request is part of that time, not added to it
            spent = asyncio.get_running_loop().time() - request.received if request.received else 0.0
            await asyncio.sleep(max(0.0, self.llama.spec.response_s - spent))
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        held = (self.llama.tokens(seq) if self.llama is not None and seq is not None else token_count(prompt)) \
            + max_tokens
        self.active_tokens += held
        try:
            await self._run(body, prompt, max_tokens, chat, fault, ex, seq)
        except (asyncio.CancelledError, ConnectionDropped):  # the client went away mid-request
            self.stats.cancelled += 1
            raise
        finally:
            self.running -= 1
            self.active_tokens -= held
            self._slots.release()

    async def _run(self, body: dict, prompt: str, max_tokens: int, chat: bool, fault: FaultPlan | None,
                   ex: Exchange, seq: Seq | None = None) -> None:
        """Run a request holding its slot (``seq``: the llama.cpp model's tokens of ``prompt``). A llama.cpp
        replica's prefill waits the model's time less what this process spent on the slot's cache update."""
        cfg = self.config
        began = asyncio.get_running_loop().time()
        output = self.llama.answer(max_tokens) if self.llama is not None else generate_text(prompt, max_tokens)
        if self.llama is not None and seq is not None:  # the slot is this request's: llama.cpp's cache update,
            # then its reuse
            prompt_tokens = self.llama.tokens(seq)
            cached = self.llama.take(seq)
            self.llama.keep(seq, output, max_tokens)
            prefill_s = self.llama.prefill_s(prompt_tokens - cached, cached)
            # llama.cpp's run-to-run variation: the request's whole time (prefill and decode) times 1 + its
            # deviation, the difference taken or given at the prefill
            deviation = drawn(cfg.time_jitter, seq)
            if deviation:
                whole = prefill_s + max_tokens * self.llama.decode_s(prompt_tokens)
                prefill_s = max(0.0, prefill_s + deviation * whole)
        else:
            prompt_tokens = token_count(prompt)
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None  # vLLM's field
            cached = self.cache.lookup(prompt, salt)
            self.cache.insert(prompt + output, salt)
            prefill_s = self.prefill_seconds(prompt_tokens - cached, cached)
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached
        self.stats.prefill_seconds += prefill_s
        mode = fault.mode if fault else None
        log.info("%s prompt_tokens=%d cached_tokens=%d max_tokens=%d fault=%s",
                 "chat" if chat else "completion", prompt_tokens, cached, max_tokens, mode)
        spent = asyncio.get_running_loop().time() - began if self.llama is not None else 0.0
        await self._prefill(max(0.0, prefill_s - spent))
        if fault is not None and mode == "slow_first_token":
            await asyncio.sleep(fault.delay_s)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        extra: dict = {}
        if cfg.metrics_style == "llamacpp" or self.llama is not None:  # llama.cpp's own report, ``timings``
            extra["timings"] = {"cache_n": cached, "prompt_n": prompt_tokens - cached,
                                "prompt_ms": round(prefill_s * 1000, 3), "predicted_n": max_tokens}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        model = str(body.get("model") or cfg.model)
        pieces = [output[i:i + BYTES_PER_TOKEN] for i in range(0, len(output), BYTES_PER_TOKEN)]
        self.decoding += 1
        try:
            if body.get("stream"):
                stream_options = body.get("stream_options")
                include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
                if not await self._stream(ex, rid, model, chat, pieces, usage if include_usage else None, fault,
                                          extra, prompt_tokens):
                    return
            elif not await self._respond(ex, rid, model, chat, output, usage, max_tokens, mode, extra,
                                         prompt_tokens):
                return
        finally:
            self.decoding -= 1
        self.stats.succeeded += 1
        self.stats.completion_tokens += max_tokens

    async def _respond(self, ex: Exchange, rid: str, model: str, chat: bool, output: str, usage: dict,
                       max_tokens: int, mode: str | None, extra: dict, context: int = 0) -> bool:
        """The non-streaming answer, after ``max_tokens`` decode steps; False when a ``cut`` fault ended it."""
        cfg = self.config
        if cfg.decode_s_per_token > 0:
            for _ in range(max_tokens):
                await self._decode_step(context)
        if mode == "cut":
            await ex.start(200, {"content-type": "application/json"}, length=4096)
            await ex.chunk(b'{"id": "' + rid.encode() + b'", "choices": [')
            ex.abort()
            return False
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output}, "finish_reason": "length",
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": output, "finish_reason": "length", "logprobs": None}
        await ex.send_json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": model, "system_fingerprint": cfg.name,
                                 "choices": [choice], "usage": usage, **extra})
        return True

    async def _stall(self, ex: Exchange, delay_s: float) -> None:
        """Hold the first token ``delay_s``, watching the client: one that leaves is noted (``stall_closes``, wall
        time) and ends the stream at once, as a provider stops generating for a closed connection."""
        loop = asyncio.get_running_loop()
        end = loop.time() + delay_s
        while (left := end - loop.time()) > 0:
            if ex.peer_gone():
                self.stats.stall_closes.append(time.time())
                del self.stats.stall_closes[:-100]
                raise ConnectionDropped()
            await asyncio.sleep(min(0.005, left))

    async def _stream(self, ex: Exchange, rid: str, model: str, chat: bool, pieces: list[str], usage: dict | None,
                      fault: FaultPlan | None, extra: dict, context: int = 0) -> bool:
        """Send the SSE stream; False when a ``cut`` fault ended it early."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **fields: object) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": model,
                       "system_fingerprint": self.config.name, "choices": choices, **fields}
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if first else {}
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        await ex.start(200, {"content-type": "text/event-stream", "cache-control": "no-cache"})
        sent = 0
        if chat:
            await ex.chunk(event([choice(None, None, first=True)]))
            sent += 1
        stall = fault.delay_s if fault is not None and fault.mode == "stall_first_token" else (
            self.config.stall.draw(self._stall_rng) if self.config.stall is not None else 0.0)
        if stall > 0:  # the stream started, its first token is late
            await self._stall(ex, stall)
        for i, piece in enumerate(pieces):
            if fault is not None and fault.mode == "cut" and sent >= fault.cut_after_chunks:
                ex.abort()
                return False
            if i and self.config.decode_s_per_token > 0:
                await self._decode_step(context + i)
            await ex.chunk(event([choice(piece, None)]))
            sent += 1
        if fault is not None and fault.mode == "cut":
            ex.abort()
            return False
        await ex.chunk(event([choice(None if chat else "", "length")]))
        if usage is not None:
            await ex.chunk(event([], usage=usage, **extra))
        await ex.chunk(b"data: [DONE]\n\n")
        await ex.end()
        return True

    # ------------------------------------------------------------------ metrics
    @property
    def kv_usage(self) -> float:
        """Share of KV blocks held by running requests, as vLLM reports it: evictable cached blocks count as free,
        so a full prefix cache at rest reads 0, not 1."""
        return min(1.0, self.active_tokens / self.cache.capacity_tokens) if self.cache.capacity_tokens else 0.0

    def metrics_text(self) -> str:
        """Prometheus exposition of queue depth, running, KV usage and prefix-cache counters."""
        s, c, m = self.stats, self.cache, self.config.model
        if self.config.metrics_style == "llamacpp" or self.llama is not None:
            rows = [("llamacpp:requests_processing", "gauge", self.running),
                    ("llamacpp:requests_deferred", "gauge", self.waiting),
                    ("llamacpp:kv_cache_usage_ratio", "gauge", self.kv_usage),
                    ("llamacpp:kv_cache_tokens", "gauge", c.used_tokens),
                    ("llamacpp:n_tokens_max", "gauge", c.capacity_tokens),
                    ("llamacpp:prompt_tokens_total", "counter", s.prompt_tokens - s.cached_tokens),
                    ("llamacpp:prompt_tokens_cached_total", "counter", s.cached_tokens),
                    ("llamacpp:prompt_seconds_total", "counter", s.prefill_seconds),
                    ("llamacpp:tokens_predicted_total", "counter", s.completion_tokens)]
            label = ""
        else:
            rows = [("vllm:num_requests_running", "gauge", self.running),
                    ("vllm:num_requests_waiting", "gauge", self.waiting),
                    ("vllm:kv_cache_usage_perc", "gauge", self.kv_usage),
                    ("vllm:prefix_cache_queries_total", "counter", c.query_tokens),
                    ("vllm:prefix_cache_hits_total", "counter", c.hit_tokens),
                    ("vllm:prompt_tokens_total", "counter", s.prompt_tokens),
                    ("vllm:prompt_tokens_cached_total", "counter", s.cached_tokens),
                    ("vllm:generation_tokens_total", "counter", s.completion_tokens),
                    ("vllm:request_success_total", "counter", s.succeeded)]
            label = '{model_name="' + m.replace('"', '') + '"}'
        lines = []
        for name, kind, value in rows:
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{label} {float(value)!r}")
        return "\n".join(lines) + "\n"


class FakeEngineServer:
    """A running fake replica on 127.0.0.1 inside the current event loop: ``async with FakeEngineServer(cfg)``."""

    def __init__(self, config: FakeEngineConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = FakeEngine(config or FakeEngineConfig())
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeEngineServer:
        self._server = await start_server(self.engine.handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def __aenter__(self) -> FakeEngineServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _main(args: argparse.Namespace) -> None:
    llama = args.engine_model == "llamacpp"
    config = FakeEngineConfig(name=args.name, model=args.model, capacity_tokens=args.capacity_tokens,
                              block_tokens=args.block_tokens, prefill_tokens_per_s=args.prefill_tps,
                              decode_s_per_token=args.decode_ms / 1000.0, slots=args.slots,
                              context_cost=args.context_cost, metrics_style="llamacpp" if llama else args.metrics_style,
                              engine_model=args.engine_model, cache_ram_mib=args.cache_ram_mib,
                              tokenizer=args.tokenizer, host_cores=args.host_cores,
                              background_cores=args.background_cores, engine_cost=args.engine_cost,
                              cores_dir=args.cores_dir, time_jitter=args.time_jitter,
                              stall=StallTail(args.stall_share, args.stall_scale_ms / 1000, args.stall_alpha,
                                              args.stall_max_ms / 1000) if args.stall_share > 0 else None,
                              stall_seed=args.stall_seed)
    server = await FakeEngineServer(config, args.host, args.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("fake engine %s listening on %s", config.name, server.base_url)
    print(f"listening on {server.base_url}", flush=True)
    if args.ready_file:
        write_ready_file(args.ready_file, server.port, config.name)
    await stop.wait()
    await server.stop()


def _deviations(text: str) -> tuple[float, ...]:
    """``--time-jitter``'s value: comma-separated numbers."""
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text[:40]!r}") from None


def parser() -> argparse.ArgumentParser:
    """The command line's options (``main``'s, and what a fleet's command is checked against)."""
    p = argparse.ArgumentParser(prog="python -m kvroute.plugin.dev.fake_engine", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port (see --ready-file)")
    p.add_argument("--name", default="fake-0")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--capacity-tokens", type=int, default=16384)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--prefill-tps", type=float, default=20000.0, help="simulated prefill speed, tokens/s")
    p.add_argument("--decode-ms", type=float, default=2.0, help="simulated decode time per output token")
    p.add_argument("--slots", type=int, default=4,
                   help="concurrent requests; others queue (--engine-model llamacpp: always one)")
    p.add_argument("--context-cost", type=float, default=FakeEngineConfig.context_cost,
                   help="attention cost per context token, relative to one token of linear prefill work")
    p.add_argument("--metrics-style", choices=("vllm", "llamacpp"), default="vllm")
    p.add_argument("--engine-model", choices=("vllm", "llamacpp"), default="vllm",
                   help="llamacpp: the bench's llama.cpp replica (the simulator's llamacpp preset: one slot, a host "
                        "prompt cache of whole prompts, token-granular reuse, the tiny model's speed)")
    p.add_argument("--cache-ram-mib", type=float, default=FakeEngineConfig.cache_ram_mib,
                   help="llamacpp: the host prompt cache's size (llama.cpp --cache-ram)")
    p.add_argument("--tokenizer", default=None, help="llamacpp: a tokenizer.json to count tokens with")
    p.add_argument("--host-cores", type=float, default=0.0,
                   help="llamacpp: cores the replicas meeting in --cores-dir share (0: each its own)")
    p.add_argument("--background-cores", type=float, default=0.0, help="llamacpp: host cores busy with other work")
    p.add_argument("--engine-cost", type=float, default=1.0,
                   help="llamacpp: how many times slower this host computes than the preset's (measured: "
                        "bench/calibrate.py)")
    p.add_argument("--cores-dir", default=None, help="llamacpp: directory the replicas sharing the cores meet in")
    p.add_argument("--time-jitter", type=_deviations, default=(),
                   help="llamacpp: comma-separated relative deviations of a request's time, one drawn per request "
                        "(measured: bench/calibrate_jitter.py)")
    p.add_argument("--stall-share", type=float, default=0.0,
                   help="share of streams whose first token stalls after the stream started (a hosted tail)")
    p.add_argument("--stall-scale-ms", type=float, default=400.0, help="the stall's Pareto scale")
    p.add_argument("--stall-alpha", type=float, default=1.2, help="the stall's Pareto shape (smaller: heavier)")
    p.add_argument("--stall-max-ms", type=float, default=5000.0, help="the longest stall")
    p.add_argument("--stall-seed", type=int, default=0, help="seed of the stall draws (reproducible runs)")
    p.add_argument("--ready-file", default=None, help="write {port, pid, name} here once listening")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(_main(args))
    except ConfigError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    main()
