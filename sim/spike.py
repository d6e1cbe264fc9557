"""A spike workload: the Azure LLM inference arrival pattern, ``factor``× for ``spike_s`` seconds.

Arrivals and lengths come from the Azure 2023 conversation trace (read from its path, never copied): a
``before_s + spike_s + after_s`` stretch starting at ``start_s``; inside the spike window the trace's own
arrivals are joined by ``factor − 1`` further stretches of the same trace (the next ones, wrapping around),
so the spike keeps the trace's burstiness and length mix. The trace has no prefixes, so a chat/agent
structure is synthesised (an assumption the notes state): each request belongs to an app with its own system
prompt; it continues an idle session of that app (5–300 s since its last turn) with the app's
``continue_prob``, re-sending the session's history plus its last answer, else starts a session. The Azure
``ContextTokens`` become the turn's new tokens (capped at ``max_turn_tokens``), ``GeneratedTokens`` its answer;
a session whose prompt would pass ``max_prompt_tokens`` starts over.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

from kvroute.policies.errors import InputError
from kvroute.sim.traces import load_azure
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

AZURE_CONV = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True, slots=True)
class AppShape:
    """One app's prefix structure: its share of requests, system prompt length, session continuation odds."""

    name: str
    weight: float
    system_tokens: int
    continue_prob: float


DEFAULT_APPS = (AppShape("chat-support", 0.35, 1500, 0.7), AppShape("chat-docs", 0.25, 3000, 0.7),
                AppShape("agent", 0.25, 6000, 0.85), AppShape("batch", 0.15, 400, 0.0))


@dataclass(frozen=True, slots=True)
class SpikeWindow:
    start_s: float
    end_s: float

    def inside(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


def _stretch(rows: list[tuple[float, int, int]], span: float, start: float, length: float,
             offset: float) -> list[tuple[float, int, int]]:
    """Rows of ``[start, start + length)`` (mod ``span``), moved to begin at ``offset``."""
    out = []
    a = start % span
    for t, ctx, gen in rows:
        rel = (t - a) % span
        if rel < length:
            out.append((offset + rel, ctx, gen))
    return out


def azure_spike(trace: str | Path, *, block_tokens: int = 64, start_s: float = 600.0, before_s: float = 600.0,
                spike_s: float = 600.0, after_s: float = 600.0, factor: int = 3, apps: tuple[AppShape, ...] =
                DEFAULT_APPS, max_turn_tokens: int = 2048, max_prompt_tokens: int = 16_000,
                seed: int = 0) -> tuple[Workload, SpikeWindow]:
    """The spike workload and its window (seconds from the start); ``factor=1`` is the same load without it."""
    if factor < 1 or not isinstance(factor, int):
        raise InputError("factor", f"must be an integer >= 1, got {factor!r}")
    if min(before_s, after_s) < 0 or spike_s <= 0:
        raise InputError("spike_s", "windows must be >= 0 and the spike > 0 seconds")
    base = load_azure(trace)
    rows = [(r.arrival, r.prompt_tokens, r.output_tokens) for r in base.requests]
    span = rows[-1][0] + 1e-3
    total = before_s + spike_s + after_s
    if total > span:
        raise InputError(str(trace), f"the trace spans {span:.0f} s, shorter than the {total:.0f} s asked for")
    chosen = _stretch(rows, span, start_s, total, 0.0)
    for k in range(1, factor):
        chosen += _stretch(rows, span, start_s + total + (k - 1) * spike_s, spike_s, before_s)
    chosen.sort(key=lambda r: r[0])
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    systems = {a.name: (seg(), a.system_tokens) for a in apps}
    weights = [a.weight for a in apps]
    open_sessions: dict[str, list[list]] = {a.name: [] for a in apps}  # [segments, last_at, answer_len, sid]
    sid = itertools.count()
    window = SpikeWindow(before_s, before_s + spike_s)
    reqs: list[SimRequest] = []
    for t, ctx, gen in chosen:
        app = rng.choices(apps, weights)[0]
        turn = (seg(), max(1, min(ctx, max_turn_tokens)))
        idle = [s for s in open_sessions[app.name] if 5.0 <= t - s[1] <= 300.0]
        session = None
        if idle and rng.random() < app.continue_prob:
            session = rng.choice(idle)
            segs = [*session[0], (seg(), session[2]), turn]
            if sum(n for _, n in segs) + gen > max_prompt_tokens:
                open_sessions[app.name].remove(session)
                session = None
        if session is None:
            segs = [systems[app.name], turn]
            session = [segs, t, gen, f"{app.name}-{next(sid)}"]
            open_sessions[app.name].append(session)
            if len(open_sessions[app.name]) > 2000:
                open_sessions[app.name].pop(0)
        session[0], session[1], session[2] = segs, t, max(1, gen)
        prompt = sum(n for _, n in segs)
        stage = 0 if t < window.start_s else (1 if window.inside(t) else 2)
        reqs.append(SimRequest(prompt, max(1, gen), kb.keys(segs), t, session=session[3], app=app.name,
                               cache_prefix_blocks=(prompt - turn[1]) // block_tokens, stage=stage))
    mean = len([r for r in reqs if r.stage != 1]) / max(1e-9, before_s + after_s)
    peak = len([r for r in reqs if r.stage == 1]) / spike_s
    notes = [f"Azure conv trace {Path(trace).name}: {start_s:g}+{total:g} s, spike x{factor} for {spike_s:g} s at "
             f"{before_s:g} s ({mean:.2f} req/s outside, {peak:.2f} inside), N={len(reqs)}",
             "SYNTHESISED prefixes (the trace has none): apps " + ", ".join(
                 f"{a.name} {a.weight:.0%} sys {a.system_tokens} cont {a.continue_prob:g}" for a in apps)
             + f"; Azure ContextTokens = a turn's new tokens (cap {max_turn_tokens}), sessions cap "
               f"{max_prompt_tokens}; open loop (a turn does not wait for the previous answer)"]
    stages = [("before", len([r for r in reqs if r.stage == 0]) / max(before_s, 1e-9)), ("spike", peak),
              ("after", len([r for r in reqs if r.stage == 2]) / max(after_s, 1e-9))]
    return Workload(f"azure-spike-x{factor}", block_tokens, reqs, notes, stages=stages), window


def busiest_window(workload: Workload, length_s: float) -> SpikeWindow:
    """The ``length_s`` window with the most arrivals (for a user's own log: where its spike is)."""
    times = sorted(r.arrival for r in workload.requests if r.follows is None)
    if not times:
        return SpikeWindow(0.0, length_s)
    best, best_start, j = 0, times[0], 0
    for i, t in enumerate(times):
        while times[j] < t - length_s:
            j += 1
        if i - j + 1 > best:
            best, best_start = i - j + 1, max(0.0, t - length_s)
    return SpikeWindow(best_start, best_start + length_s)
