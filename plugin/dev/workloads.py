"""The replayed traffic as conversations, one builder per shape: the demo's shared-prefix chat, apps with one-off
prompts, agents whose context grows, and the coding agent of ``bench/llamacpp_agent.py``.

A ``Conversation`` is a system prompt and the user turns sent one after another, each after the previous answer;
``start_s`` is when it may start (0: at once). Every builder is deterministic: its output depends on its
arguments and on ``corpus()`` only (the installed stdlib's source text, or a fixed fallback).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from kvroute.policies.errors import ConfigError

CHARS_PER_TOKEN = 4  # the fake engine's tokenizer; llama.cpp's tiny model is close enough for sizing
VOCABULARY = tuple(f"{w}{i}" for i in range(40) for w in ("req", "ctx", "kv", "node", "span", "row", "tool"))
_FALLBACK_TEXT = " ".join(f"def handler_{i}(request, context): return route(request, context, {i})"
                          for i in range(400))


@dataclass(frozen=True)
class Conversation:
    """One session: ``system`` (shared by the sessions with the same ``system_id``), then ``turns`` in order."""

    conv_id: str
    system: str
    turns: tuple[str, ...]
    start_s: float = 0.0
    system_id: int = 0


@cache
def corpus() -> str:
    """Source text to cut prompts from: the last 40 stdlib modules, or a fixed text where they are missing."""
    from kvroute.plugin.dev.tiny_model import stdlib_sources

    parts = []
    for path in stdlib_sources()[::-1][:40]:
        try:
            parts.append(path.read_text(encoding="utf-8", errors="ignore"))
        except OSError:
            continue
    text = "".join(parts)
    return text if len(text) > 100_000 else (_FALLBACK_TEXT * 20)


def vocabulary_text(rng: random.Random, tokens: int, vocabulary: Sequence[str] = VOCABULARY) -> str:
    """About ``tokens`` tokens of words drawn from ``vocabulary`` by ``rng``."""
    words: list[str] = []
    chars = 0
    while chars < tokens * CHARS_PER_TOKEN:
        word = rng.choice(vocabulary)
        words.append(word)
        chars += len(word) + 1
    return " ".join(words)


# ------------------------------------------------------------------------------------------ the demo's chat
@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of the demo's traffic; ``requests`` is per policy."""

    requests: int = 48
    turns: int = 4
    prefixes: int = 6
    prefix_tokens: int = 1024
    max_tokens: int = 8
    concurrency: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("requests", "turns", "prefixes", "prefix_tokens", "max_tokens", "concurrency"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, "must be a positive integer")

    @property
    def sessions(self) -> int:
        return math.ceil(self.requests / self.turns)

    @property
    def shared_prefixes(self) -> int:
        """Distinct system prompts actually used: at most one per two sessions, so every prefix is shared."""
        return max(1, min(self.prefixes, self.sessions // 2))


def build_sessions(spec: WorkloadSpec, id_prefix: str = "") -> list[Conversation]:
    """The demo's sessions: exactly ``spec.requests`` turns, shared long system prompts interleaved."""
    text = corpus()
    chars = spec.prefix_tokens * 4
    rng = random.Random(spec.seed)
    prefixes = []
    for p in range(spec.shared_prefixes):
        start = (p * chars * 3) % max(1, len(text) - chars)
        prefixes.append(f"You are assistant #{p}. Answer questions about this code.\n" + text[start:start + chars])
    sessions = []
    remaining = spec.requests
    sid = 0
    while remaining > 0:
        turns = min(spec.turns, remaining)
        prefix_id = sid % spec.shared_prefixes
        questions = tuple(f"Session {sid}, question {t}: what does line {rng.randint(1, 400)} do, and why?"
                          for t in range(turns))
        sessions.append(Conversation(f"{id_prefix}{sid}", prefixes[prefix_id], questions, system_id=prefix_id))
        remaining -= turns
        sid += 1
    return sessions


# ------------------------------------------------------------------------------------------ apps and agents
_APP_TURNS_PER_FLOW = 2.5  # 20 % one-off flows of 1 turn, as many sessions of 4 turns on average


def app_sessions(apps: int, requests: int, rate_per_s: float, prefix_tokens: int,
                 seed: int = 1) -> list[Conversation]:
    """Several apps, each with its own long system prompt; sessions of 2–6 turns and one-off unique prompts
    (20 % of requests) arriving as a Poisson process at ``rate_per_s`` requests per second."""
    rng = random.Random(seed)
    systems = [f"You are app {a}'s assistant. Policy and reference:\n" + vocabulary_text(rng, prefix_tokens)
               for a in range(apps)]
    weights = [1.0 / (a + 1) for a in range(apps)]  # a few popular apps, a long tail
    flows: list[Conversation] = []
    unique_left = round(0.2 * requests)
    shared_left = requests - unique_left
    t = 0.0
    n = 0
    while unique_left or shared_left:
        if unique_left and (not shared_left or rng.random() < unique_left / (unique_left + shared_left)):
            turns: tuple[str, ...] = (vocabulary_text(rng, prefix_tokens // 2),)
            system, system_id = f"One-off request {n}.", -1
            unique_left -= 1
        else:
            app = rng.choices(range(apps), weights)[0]
            k = min(shared_left, rng.randint(2, 6))
            turns = tuple(f"Session {n}, turn {i}: explain item {rng.randint(1, 999)} briefly." for i in range(k))
            system, system_id = systems[app], app
            shared_left -= k
        flows.append(Conversation(f"apps-{n}", system, turns, t, system_id))
        t += rng.expovariate(rate_per_s / _APP_TURNS_PER_FLOW)
        n += 1
    return flows


def tool_loops(agents: int, steps: int, rate_per_s: float, prefix_tokens: int, final_tokens: float,
               seed: int = 2) -> list[Conversation]:
    """Agent loops: a tools-heavy system prompt, then tool results appended step after step until the context
    is about ``final_tokens``; agents start as a Poisson process at ``rate_per_s``."""
    rng = random.Random(seed)
    tools = "Tools:\n" + "\n".join(f"- tool_{i}(arg, ctx): " + vocabulary_text(rng, prefix_tokens // 16)
                                  for i in range(12))
    system = "You are a coding agent. Call one tool per step.\n" + tools
    step_tokens = max(32, int((final_tokens - prefix_tokens) / max(1, steps)))
    flows = []
    t = 0.0
    for a in range(agents):
        turns = tuple(f"tool_{rng.randint(0, 11)} result for agent {a} step {s}:\n"
                      + vocabulary_text(rng, step_tokens) for s in range(steps))
        flows.append(Conversation(f"agent-{a}", system, turns, t))
        t += rng.expovariate(rate_per_s)
    return flows


def coding_agent_sessions(sessions: int, turns: int, tools_tokens: int, task_tokens: int,
                          tool_output_tokens: int) -> list[Conversation]:
    """A shared tools prompt; per session a task, then ``turns - 1`` tool outputs (stdlib text, fixed offsets)."""
    text = corpus()

    def piece(i: int, tokens: int) -> str:
        chars = tokens * 4
        start = (i * 7919 * 4) % max(1, len(text) - chars)
        return text[start:start + chars]

    tools = "You are a coding agent. Tools: read_file, run_tests, grep, edit.\n" + piece(1, tools_tokens)
    out = []
    for s in range(sessions):
        task = f"Task {s}: fix the failing test in module {s}.\n" + piece(100 + s, task_tokens)
        outputs = tuple(f"tool output {s}.{t}:\n" + piece(1000 + s * 97 + t, tool_output_tokens)
                        for t in range(turns - 1))
        out.append(Conversation(f"agent-{s}", tools, (task, *outputs)))
    return out
