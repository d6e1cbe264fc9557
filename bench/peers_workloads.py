"""The three workloads of ``bench/peers.py`` as flows of chat turns, and the streaming client that replays them.

A ``Flow`` is one conversation: it starts at ``start_s`` after the run begins and sends its turns one after
another, each turn appending the previous answer and its own message. ``demo`` is the demo's closed-loop
shared-prefix chat; ``apps`` is several apps × multi-turn sessions with Poisson arrivals and 20 % unique prompts;
``agent`` is tool-calling loops whose context grows past one replica's cache. Every prompt of a run starts with
the run's salt, so no run reuses the cache another run left behind.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from kvroute.plugin.demo_workload import WorkloadSpec, build_sessions

WORKLOADS = ("demo", "apps", "agent")
CHARS_PER_TOKEN = 4  # the fake engine's tokenizer; llama.cpp's tiny model is close enough for sizing


@dataclass(frozen=True)
class Flow:
    """One conversation: a system prompt, then ``turns`` sent in order (each as a user or tool-result message)."""

    flow_id: str
    start_s: float
    system: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    """The flows of one run, ``concurrency`` of them in flight at most (0: open loop, all at their start)."""

    name: str
    flows: tuple[Flow, ...]
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

    @classmethod
    def llamacpp(cls) -> Size:
        """Smaller for llama.cpp, whose CPU prefill is ~50× slower than the fake engine's default."""
        return cls(demo_requests=24, app_requests=30, app_rate_per_s=3.0, agents=3, agent_steps=6,
                   agent_rate_per_s=1.0, prefix_tokens=768)

    @classmethod
    def quick(cls) -> Size:
        return cls(demo_requests=8, apps=2, app_requests=8, app_rate_per_s=8.0, agents=2, agent_steps=3,
                   agent_rate_per_s=4.0, prefix_tokens=512)


def replica_capacity_tokens(size: Size, replicas: int) -> int:
    """Cache room per replica: its share of the demo's shared prefixes plus one (as ``kvroute demo`` sizes it).

    The apps' system prompts fit only when each app sticks to a replica; the agents' contexts outgrow it.
    """
    spec = _demo_spec(size)
    per_replica = math.ceil(spec.shared_prefixes / replicas) + 1
    return per_replica * (spec.prefix_tokens + 64 * spec.turns + 64)


def _demo_spec(size: Size) -> WorkloadSpec:
    return WorkloadSpec(requests=size.demo_requests, turns=4, prefixes=6, prefix_tokens=size.prefix_tokens,
                        max_tokens=8, concurrency=4, seed=0)


def _text(rng: random.Random, tokens: int, vocabulary: Sequence[str]) -> str:
    words: list[str] = []
    chars = 0
    while chars < tokens * CHARS_PER_TOKEN:
        word = rng.choice(vocabulary)
        words.append(word)
        chars += len(word) + 1
    return " ".join(words)


_VOCABULARY = tuple(f"{w}{i}" for i in range(40) for w in ("req", "ctx", "kv", "node", "span", "row", "tool"))


def demo(size: Size) -> Workload:
    """The demo's sessions (``plugin/demo_workload.py``): shared long system prompts, 4 turns, 4 sessions at once."""
    spec = _demo_spec(size)
    flows = tuple(Flow(f"demo-{s.sid}", 0.0, s.system, s.questions) for s in build_sessions(spec))
    return Workload("demo", flows, concurrency=spec.concurrency, max_tokens=spec.max_tokens)


_APP_TURNS_PER_FLOW = 2.5  # 20 % one-off flows of 1 turn, as many sessions of 4 turns on average


def apps(size: Size, seed: int = 1) -> Workload:
    """Several apps, each with its own long system prompt; sessions of 2–6 turns and one-off unique prompts
    (20 % of requests) arrive as a Poisson process at ``app_rate_per_s`` requests per second."""
    rng = random.Random(seed)
    systems = [f"You are app {a}'s assistant. Policy and reference:\n" + _text(rng, size.prefix_tokens, _VOCABULARY)
               for a in range(size.apps)]
    weights = [1.0 / (a + 1) for a in range(size.apps)]  # a few popular apps, a long tail
    flows: list[Flow] = []
    unique_left = round(0.2 * size.app_requests)
    shared_left = size.app_requests - unique_left
    t = 0.0
    n = 0
    while unique_left or shared_left:
        if unique_left and (not shared_left or rng.random() < unique_left / (unique_left + shared_left)):
            turns: tuple[str, ...] = (_text(rng, size.prefix_tokens // 2, _VOCABULARY),)
            system = f"One-off request {n}."
            unique_left -= 1
        else:
            app = rng.choices(range(size.apps), weights)[0]
            k = min(shared_left, rng.randint(2, 6))
            turns = tuple(f"Session {n}, turn {i}: explain item {rng.randint(1, 999)} briefly." for i in range(k))
            system = systems[app]
            shared_left -= k
        flows.append(Flow(f"apps-{n}", t, system, turns))
        t += rng.expovariate(size.app_rate_per_s / _APP_TURNS_PER_FLOW)
        n += 1
    return Workload("apps", tuple(flows), concurrency=0, max_tokens=8)


def agent(size: Size, capacity_tokens: int, seed: int = 2) -> Workload:
    """Agent loops: a tools-heavy system prompt, then tool results appended step after step until the context
    is about 1.3 × one replica's cache; agents start as a Poisson process at ``agent_rate_per_s``."""
    rng = random.Random(seed)
    tools = "Tools:\n" + "\n".join(f"- tool_{i}(arg, ctx): " + _text(rng, size.prefix_tokens // 16, _VOCABULARY)
                                  for i in range(12))
    system = "You are a coding agent. Call one tool per step.\n" + tools
    step_tokens = max(32, int((1.3 * capacity_tokens - size.prefix_tokens) / max(1, size.agent_steps)))
    flows = []
    t = 0.0
    for a in range(size.agents):
        turns = tuple(f"tool_{rng.randint(0, 11)} result for agent {a} step {s}:\n"
                      + _text(rng, step_tokens, _VOCABULARY) for s in range(size.agent_steps))
        flows.append(Flow(f"agent-{a}", t, system, turns))
        t += rng.expovariate(size.agent_rate_per_s)
    return Workload("agent", tuple(flows), concurrency=0, max_tokens=8)


def build(name: str, size: Size, capacity_tokens: int) -> Workload:
    """The workload called ``name`` (one of ``WORKLOADS``)."""
    if name == "demo":
        return demo(size)
    if name == "apps":
        return apps(size)
    if name == "agent":
        return agent(size, capacity_tokens)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class Outcome:
    """One request as the client saw it (no prompt text)."""

    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class RunResult:
    """Every request of one run and the run's wall time."""

    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


async def _stream_one(client: httpx.AsyncClient, body: dict, headers: Mapping[str, str]) -> tuple[Outcome, str]:
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(False, latency_s=time.perf_counter() - start,
                               error=f"HTTP {response.status_code}"), ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(False, latency_s=time.perf_counter() - start, error="stream error"), ""
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        parts.append(content)
    except (httpx.HTTPError, ValueError) as exc:
        return Outcome(False, latency_s=time.perf_counter() - start, error=type(exc).__name__), ""
    latency = time.perf_counter() - start
    return Outcome(True, ttft_s=ttft if ttft is not None else latency, latency_s=latency), "".join(parts)


async def replay(base_url: str, headers: Mapping[str, str], model: str, workload: Workload, salt: str,
                 timeout_s: float = 120.0) -> RunResult:
    """Send every flow of ``workload`` to ``base_url`` (streaming, usage included); every prompt starts with
    ``salt``. Each conversation carries ``x-litellm-session-id`` (LiteLLM's session affinity reads it)."""
    result = RunResult()
    limit = workload.concurrency or len(workload.flows) or 1
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=max(8, limit), max_keepalive_connections=max(8, limit))
    async with httpx.AsyncClient(base_url=base_url, headers=dict(headers), timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        start = time.perf_counter()

        async def run_flow(flow: Flow) -> None:
            delay = flow.start_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                messages: list[dict] = [{"role": "system", "content": f"[{salt}] {flow.system}"}]
                session = {"x-litellm-session-id": f"{salt}-{flow.flow_id}"}
                for turn in flow.turns:
                    messages.append({"role": "user", "content": turn})
                    body = {"model": model, "messages": messages, "max_tokens": workload.max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                    outcome, answer = await _stream_one(client, body, session)
                    result.outcomes.append(outcome)
                    messages.append({"role": "assistant", "content": answer or "(no answer)"})

        await asyncio.gather(*(run_flow(f) for f in workload.flows))
        result.wall_s = time.perf_counter() - start
    return result
