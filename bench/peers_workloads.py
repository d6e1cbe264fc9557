"""The four workloads of ``bench/peers.py`` as flows of chat turns, and the streaming client that replays them.

A flow is one ``Conversation`` (``kvroute.plugin.dev.workloads``, where the builders live): it starts at ``start_s``
after the run begins and sends its turns one after another, each turn appending the previous answer and its
own message. ``demo`` is the demo's closed-loop
shared-prefix chat; ``apps`` is several apps × multi-turn sessions with Poisson arrivals and 20 % unique prompts;
``agent`` is tool-calling loops whose context grows past one replica's cache; ``shared`` is the field's
one-shared-prefix shape (one system prompt of 2,548 tokens, each request its own 7,252-token question, 3 req/s
on 2 workers there) scaled to this fleet: the same split shrunk to 3/4 of one replica's cache, 1.5 req/s per
replica (fake engines; llama.cpp: 0.5). Every prompt of a run starts with a salt of the run and its system prompt
(``system_content``), so no run reuses the cache another run left behind, and unrelated prompts of one run share
nothing but the chat template. The replay records, per request, which replica answered (the
``system_fingerprint`` the fake engine stamps; None where an engine does not say) and what it reported cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx
from replica_relay import replica_of

from kvroute.plugin.dev import demo as _demo
from kvroute.plugin.dev.fake_engine import render_chat
from kvroute.plugin.dev.workloads import (
    Conversation,
    WorkloadSpec,
    app_sessions,
    build_sessions,
    tool_loops,
    vocabulary_text,
)

WORKLOADS = ("demo", "apps", "agent", "shared", "apps-large")
DEFAULT_WORKLOADS = WORKLOADS[:4]  # apps-large is the scale cell, asked for by name


@dataclass(frozen=True)
class Workload:
    """The flows of one run, ``concurrency`` of them in flight at most (0: open loop, all at their start)."""

    name: str
    flows: tuple[Conversation, ...]
    concurrency: int = 0
    max_tokens: int = 8

    @property
    def requests(self) -> int:
        return sum(len(f.turns) for f in self.flows)


@dataclass(frozen=True)
class Size:
    """How big each workload is; ``quick`` keeps CI under a couple of minutes."""

    demo_requests: int = 32
    apps: int = 6
    app_requests: int = 40
    app_rate_per_s: float = 6.0
    agents: int = 4
    agent_steps: int = 8
    agent_rate_per_s: float = 2.0
    prefix_tokens: int = 1024
    # one shared prefix: the field's 3 req/s on 2 workers is 1.5 req/s per replica, 6 req/s for 4
    shared_requests: int = 48
    shared_rate_per_s: float = 6.0
    # the scale cell: the apps mix with more apps and requests (run it with --replicas 8)
    large_apps: int = 12
    large_app_requests: int = 200

    @classmethod
    def llamacpp(cls) -> Size:
        """Smaller for llama.cpp, whose CPU prefill is ~50× slower than the fake engine's default (four 1-thread
        replicas share this machine's cores: the shared shape at 2 req/s, not 6)."""
        return cls(demo_requests=24, app_requests=30, app_rate_per_s=3.0, agents=3, agent_steps=6,
                   agent_rate_per_s=1.0, prefix_tokens=768, shared_requests=16, shared_rate_per_s=2.0)

    @classmethod
    def quick(cls) -> Size:
        return cls(demo_requests=8, apps=2, app_requests=8, app_rate_per_s=8.0, agents=2, agent_steps=3,
                   agent_rate_per_s=4.0, prefix_tokens=512, shared_requests=6, shared_rate_per_s=8.0,
                   large_apps=4, large_app_requests=16)


def replica_capacity_tokens(size: Size, replicas: int) -> int:
    """Cache room per replica, as ``kvroute demo`` sizes it for the demo's shared prefixes.

    The apps' system prompts fit only when each app sticks to a replica; the agents' contexts outgrow it.
    """
    return _demo.replica_capacity_tokens(_demo_spec(size), replicas)


def _demo_spec(size: Size) -> WorkloadSpec:
    return WorkloadSpec(requests=size.demo_requests, turns=4, prefixes=6, prefix_tokens=size.prefix_tokens,
                        max_tokens=8, concurrency=4, seed=0)


def demo(size: Size) -> Workload:
    """The demo's sessions: shared long system prompts, 4 turns, 4 sessions at once."""
    spec = _demo_spec(size)
    return Workload("demo", tuple(build_sessions(spec, id_prefix="demo-")), concurrency=spec.concurrency,
                    max_tokens=spec.max_tokens)


def apps(size: Size, seed: int = 1) -> Workload:
    """Several apps × multi-turn sessions with Poisson arrivals and 20 % one-off prompts."""
    return Workload("apps", tuple(app_sessions(size.apps, size.app_requests, size.app_rate_per_s,
                                               size.prefix_tokens, seed)), concurrency=0, max_tokens=8)


def apps_large(size: Size, seed: int = 4) -> Workload:
    """The apps mix at scale: ``large_apps`` apps, ``large_app_requests`` requests at the apps' rate."""
    return Workload("apps-large", tuple(app_sessions(size.large_apps, size.large_app_requests, size.app_rate_per_s,
                                                     size.prefix_tokens, seed)), concurrency=0, max_tokens=8)


def agent(size: Size, capacity_tokens: int, seed: int = 2) -> Workload:
    """Tool-calling loops whose context grows to about 1.3 × one replica's cache."""
    return Workload("agent", tuple(tool_loops(size.agents, size.agent_steps, size.agent_rate_per_s,
                                              size.prefix_tokens, 1.3 * capacity_tokens, seed)),
                    concurrency=0, max_tokens=8)


FIELD_SYSTEM_TOKENS, FIELD_QUESTION_TOKENS = 2548, 7252  # the field case's one shared prefix and question


def shared_tokens(capacity_tokens: int, fill: float = 0.75) -> tuple[int, int]:
    """(system, question) tokens of the shared shape: the field's split, the whole prompt at most ``fill`` of one
    replica's cache (the field's 9.8k-token prompt fits a GPU replica's cache; here it would not)."""
    scale = min(1.0, fill * capacity_tokens / (FIELD_SYSTEM_TOKENS + FIELD_QUESTION_TOKENS))
    return round(FIELD_SYSTEM_TOKENS * scale), round(FIELD_QUESTION_TOKENS * scale)


def shared(size: Size, capacity_tokens: int, seed: int = 3) -> Workload:
    """One system prompt shared by every request, each with its own long question, at a fixed rate (open loop)."""
    rng = random.Random(seed)
    system_tokens, question_tokens = shared_tokens(capacity_tokens)
    system = "You are the support assistant. Reference manual:\n" + vocabulary_text(rng, system_tokens)
    flows = tuple(Conversation(f"shared-{n}", system, (f"Question {n}: " + vocabulary_text(rng, question_tokens),),
                               n / size.shared_rate_per_s, 0) for n in range(size.shared_requests))
    return Workload("shared", flows, concurrency=0, max_tokens=8)


def build(name: str, size: Size, capacity_tokens: int) -> Workload:
    """The workload called ``name`` (one of ``WORKLOADS``)."""
    if name == "demo":
        return demo(size)
    if name == "apps":
        return apps(size)
    if name == "agent":
        return agent(size, capacity_tokens)
    if name == "shared":
        return shared(size, capacity_tokens)
    if name == "apps-large":
        return apps_large(size)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class Outcome:
    """One request as the client saw it (no prompt text)."""

    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None
    replica: str | None = None  # the engine's system_fingerprint (the fake engine's replica name)
    prompt_tokens: int | None = None  # as the engine reported them in usage
    cached_tokens: int | None = None
    prompt: str = ""  # the rendered prompt and the answer, for wasted prefill; never printed or saved
    answer: str = ""
    start_s: float = 0.0  # since the run began
    end_s: float = 0.0
    flow: str = ""  # the conversation's id and this request's turn in it: the same request in every rival's run
    turn: int = 0
    system_id: int = 0  # which shared system prompt the conversation starts with (-1: its own)
    call_id: str = ""  # sent as x-litellm-call-id: LiteLLM (and kvroute's decision log) keeps it
    prompt_ms: float | None = None  # llama.cpp's own prefill time (``timings.prompt_ms``), where it sent one

    def record(self) -> dict:
        """What the harness keeps of this request (no prompt or answer text)."""
        return {"flow": self.flow, "turn": self.turn, "system_id": self.system_id, "call_id": self.call_id,
                "ok": self.ok, "replica": self.replica, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
                "start_s": round(self.start_s, 4), "end_s": round(self.end_s, 4)}


@dataclass
class RunResult:
    """Every request of one run and the run's wall time."""

    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    t0: float = 0.0  # time.perf_counter() when the run began: ``start_s`` counts from it


def _usage_cached(usage: dict, chunk: dict) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    timings = chunk.get("timings") or {}  # llama.cpp's own report
    return timings.get("cache_n") if isinstance(timings.get("cache_n"), int) else None


async def stream_one(client: httpx.AsyncClient, body: dict, headers: Mapping[str, str]) -> Outcome:
    """One streamed request; the outcome's ``answer`` is the text streamed back."""
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    out = Outcome(False)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                out.latency_s, out.error = time.perf_counter() - start, f"HTTP {response.status_code}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.latency_s, out.error = time.perf_counter() - start, "stream error"
                    return out
                out.replica = out.replica or replica_of(chunk.get("system_fingerprint"))
                timings = chunk.get("timings")
                if isinstance(timings, dict) and isinstance(timings.get("prompt_ms"), int | float):
                    out.prompt_ms = float(timings["prompt_ms"])
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                    out.prompt_tokens, out.cached_tokens = usage["prompt_tokens"], _usage_cached(usage, chunk)
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        parts.append(content)
    except (httpx.HTTPError, ValueError) as exc:
        out.latency_s, out.error = time.perf_counter() - start, type(exc).__name__
        return out
    out.latency_s = time.perf_counter() - start
    out.ok, out.ttft_s, out.answer = True, ttft if ttft is not None else out.latency_s, "".join(parts)
    return out


def session_key(salt: str, conv_id: str) -> str:
    """The session key a run's conversation carries (``x-litellm-session-id``), and the stem of its call ids."""
    return f"{salt}-{conv_id}"


def call_id(salt: str, conv_id: str, turn: int) -> str:
    """The ``x-litellm-call-id`` of a run's turn (kvroute's decision log keeps it)."""
    return f"{session_key(salt, conv_id)}-{turn}"


def salt_of(call: str, conv_id: str, turn: int) -> str:
    """The run's salt back from one of its call ids (``call_id``'s inverse); ValueError for another's."""
    tail = f"-{conv_id}-{turn}"
    if not call.endswith(tail) or len(call) == len(tail):
        raise ValueError(f"call id {call!r} is not turn {turn} of {conv_id!r}")
    return call[: -len(tail)]


def system_content(salt: str, flow: Conversation) -> str:
    """``flow``'s system prompt behind a salt of the run (``salt``) and of that system prompt (of the conversation
    itself for a one-off prompt), 16 hex characters: prompts of one system prompt share it, unrelated ones share
    nothing but the chat template. A run-wide salt was a prefix every prompt of the run shared, which the engines
    counted as cached wherever a replica had served any of them (up to ~20 tokens of a new prompt's first turn,
    decided by where a router happened to put it)."""
    who = flow.system_id if flow.system_id >= 0 else f"own-{flow.conv_id}"
    return f"[{hashlib.sha256(f'{salt}-{who}'.encode()).hexdigest()[:16]}] {flow.system}"


async def replay(base_url: str, headers: Mapping[str, str], model: str, workload: Workload, salt: str,
                 timeout_s: float = 120.0,
                 flow_headers: Callable[[Conversation], Mapping[str, str]] | None = None,
                 delays: Callable[[Conversation, int], float] | None = None) -> RunResult:
    """Send every flow of ``workload`` to ``base_url`` (streaming, usage included); every system prompt is salted
    with ``salt`` by ``system_content``. Each conversation carries its session key in ``x-litellm-session-id``
    (LiteLLM's session affinity and kvroute read it) and, the same value, in ``x-session-id`` (vllm-router's
    sticky and hash policies read it first; SMG's sticky sessions are pointed at it with
    ``--routing-key-headers``); ``flow_headers`` adds a flow's own (e.g. its app's API key); ``delays(flow, n)``
    holds turn ``n`` back that many seconds more (turn 0: after the flow's start; later turns: after the turn
    before ends)."""
    result = RunResult()
    limit = workload.concurrency or len(workload.flows) or 1
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=max(8, limit), max_keepalive_connections=max(8, limit))
    async with httpx.AsyncClient(base_url=base_url, headers=dict(headers), timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        start = result.t0 = time.perf_counter()

        async def run_flow(flow: Conversation) -> None:
            delay = flow.start_s + (delays(flow, 0) if delays else 0.0) - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                messages: list[dict] = [{"role": "system", "content": system_content(salt, flow)}]
                key = session_key(salt, flow.conv_id)
                session = {"x-litellm-session-id": key, "x-session-id": key,
                           **(flow_headers(flow) if flow_headers else {})}
                for n, turn in enumerate(flow.turns):
                    if n and delays and (extra := delays(flow, n)) > 0:
                        await asyncio.sleep(extra)
                    messages.append({"role": "user", "content": turn})
                    body = {"model": model, "messages": messages, "max_tokens": workload.max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                    sent_at = time.perf_counter() - start
                    turn_id = call_id(salt, flow.conv_id, n)
                    outcome = await stream_one(client, body, {**session, "x-litellm-call-id": turn_id})
                    outcome.start_s, outcome.end_s = sent_at, time.perf_counter() - start
                    outcome.flow, outcome.turn, outcome.system_id, outcome.call_id = (flow.conv_id, n, flow.system_id,
                                                                                      turn_id)
                    outcome.prompt = render_chat(messages)
                    result.outcomes.append(outcome)
                    messages.append({"role": "assistant", "content": outcome.answer or "(no answer)"})

        await asyncio.gather(*(run_flow(f) for f in workload.flows))
        result.wall_s = time.perf_counter() - start
    return result
