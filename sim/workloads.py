"""Workload generators with the anchors' exact parameters (their upstream benchmark defaults), plus chat, RAG,
agent loops and unique short prompts. Prompts are segment lists hashed into block keys; no text exists.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

from kvroute.sim.workload import SegmentKeys, SimRequest, Workload


def _poisson(rng: random.Random, rate: float, n: int, start: float = 0.0) -> list[float]:
    if math.isinf(rate):
        return [start] * n
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _lens(rng: random.Random, length: int, range_ratio: float, n: int) -> list[int]:
    if range_ratio >= 1.0:
        return [length] * n
    return [rng.randint(max(1, int(length * range_ratio)), length) for _ in range(n)]


def gsp(block_tokens: int, *, groups: int = 64, prompts_per_group: int = 16, system_len: int = 2048,
        question_len: int = 128, output_len: int = 256, range_ratio: float = 1.0, rate: float = math.inf,
        seed: int = 1) -> Workload:
    """SGLang ``generated-shared-prefix``: G·P prompts = system[g] + question, shuffled, all at t=0 by default."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    sys_lens = _lens(rng, system_len, range_ratio, groups)
    rows = []
    for g in range(groups):
        sys_seg = (seg(), sys_lens[g])
        for q_len in _lens(rng, question_len, range_ratio, prompts_per_group):
            rows.append((sys_seg, (seg(), q_len), g))
    rng.shuffle(rows)
    arrivals = _poisson(rng, rate, len(rows))
    reqs = []
    for (sys_seg, q_seg, g), t in zip(rows, arrivals, strict=True):
        keys = kb.keys([sys_seg, q_seg])
        reqs.append(SimRequest(sys_seg[1] + q_seg[1], output_len, keys, t, app=f"group-{g}",
                               cache_prefix_blocks=sys_seg[1] // block_tokens))
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    return Workload("gsp", block_tokens, reqs, [
        f"SGLang gsp: {groups}x{prompts_per_group}, system {system_len}, question {question_len}, "
        f"output {output_len}, range {range_ratio}, rate {rate_s}, seed {seed}"])


def one_shared_prefix(block_tokens: int, *, requests: int = 400, system_len: int = 2548, question_len: int = 7252,
                      output_len: int = 256, rate: float = 3.0, seed: int = 1) -> Workload:
    """SGLang ``generated-shared-prefix`` with one group: every prompt = one shared system prompt + its own long
    question, Poisson ``rate``. The field case where SGLang's ``cache_aware`` on two workers lost to round robin
    (TTFT ~1,617 vs ~627 ms): one prefix concentrates all load on its holder."""
    wl = gsp(block_tokens, groups=1, prompts_per_group=requests, system_len=system_len, question_len=question_len,
             output_len=output_len, rate=rate, seed=seed)
    wl.name = "one-shared-prefix"
    wl.notes = [f"one shared prefix: {requests} prompts, system {system_len} + question {question_len}, output "
                f"{output_len}, Poisson {rate:g}/s, seed {seed}"]
    return wl


#: llm-d guide.yaml (precise-prefix-cache-aware benchmark template): (QPS, seconds) per Poisson stage.
LLMD_LADDER: tuple[tuple[float, float], ...] = (
    (3, 20), (10, 20), (15, 20), (20, 38), (22, 34), (25, 30), (30, 25), (35, 21), (40, 38), (43, 36), (46, 33),
    (49, 30), (52, 29), (55, 27), (57, 26), (60, 25))


def llmd_shared_prefix(block_tokens: int, *, groups: int = 150, prompts_per_group: int = 5,
                       system_len: int = 6000, question_len: int = 1200, output_len: int = 1000,
                       warmup_rate: float = 15.0, warmup_s: float = 50.0,
                       ladder: Sequence[tuple[float, float]] = LLMD_LADDER, seed: int = 0,
                       scale: float = 1.0, max_concurrency: int | None = None) -> Workload:
    """inference-perf ``shared_prefix`` (llm-d precise-prefix guide): 150×5, 6000/1200/1000, Poisson
    warm-up 15 QPS × 50 s then the 3→60 QPS ladder (N = 17,084); request i reuses prompt ``i mod G·P``.

    ``scale`` shrinks every stage for quick runs; ``max_concurrency`` caps the client's in-flight requests
    (requests over the cap wait client-side and their TTFT starts when they are sent).
    """
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    prompts = []
    for g in range(groups):
        sys_seg = (seg(), system_len)
        for _ in range(prompts_per_group):
            prompts.append((sys_seg, (seg(), question_len), g))
    rng.shuffle(prompts)
    keys_of = [kb.keys([s, q]) for s, q, _ in prompts]
    stages = [("warmup", warmup_rate, warmup_s * scale)] + [(f"{r:g}", r, d * scale) for r, d in ladder]
    reqs: list[SimRequest] = []
    t0 = 0.0
    i = 0
    for si, (_label, rate, dur) in enumerate(stages):
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= t0 + dur:
                break
            p = i % len(prompts)
            s, q, g = prompts[p]
            reqs.append(SimRequest(s[1] + q[1], output_len, keys_of[p], t, app=f"group-{g}",
                                   cache_prefix_blocks=system_len // block_tokens, stage=si))
            i += 1
        t0 += dur
    return Workload("llmd-ladder", block_tokens, reqs, [
        f"llm-d shared_prefix {groups}x{prompts_per_group}, {system_len}/{question_len}/{output_len}, "
        f"Poisson warm-up {warmup_rate:g} QPS x {warmup_s * scale:g} s, ladder "
        f"{','.join(f'{r:g}x{d * scale:g}s' for r, d in ladder)}, N={len(reqs)}, client max concurrency "
        f"{max_concurrency or 'none'}"],
        stages=[(label, rate) for label, rate, _ in stages], first_pass=groups * prompts_per_group,
        max_concurrency=max_concurrency)


def prefix_repetition(block_tokens: int, *, prefix_len: int = 256, suffix_len: int = 256, num_prefixes: int = 10,
                      output_len: int = 128, num_prompts: int = 1000, rate: float = math.inf,
                      seed: int = 0) -> Workload:
    """vLLM ``prefix_repetition``: N // num_prefixes prompts per prefix, random suffixes, shuffled."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    rows = []
    for p in range(num_prefixes):
        pre = (seg(), prefix_len)
        for _ in range(num_prompts // num_prefixes):
            rows.append((pre, (seg(), suffix_len), p))
    rng.shuffle(rows)
    reqs = [SimRequest(prefix_len + suffix_len, output_len, kb.keys([pre, suf]), t, app=f"prefix-{p}",
                       cache_prefix_blocks=prefix_len // block_tokens)
            for (pre, suf, p), t in zip(rows, _poisson(rng, rate, len(rows)), strict=True)]
    return Workload("prefix-repetition", block_tokens, reqs, [
        f"vLLM prefix_repetition: {num_prefixes} prefixes x {num_prompts // num_prefixes}, "
        f"{prefix_len}+{suffix_len} -> {output_len}"])


def prefix_ratio(block_tokens: int, *, isl: int = 14000, osl: int = 200, requests: int = 200, concurrency: int = 20,
                 num_prefix_prompts: int = 20, ratio: float = 0.5, seed: int = 0) -> Workload:
    """Dynamo ``prefix_ratio_benchmark``: prefix isl·r from a pool of 20 (uniform), suffix ~N(isl(1−r), /4),
    output ~N(200, 50); closed loop at fixed ``concurrency`` (each client sends its next request at once)."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    pre_len = int(isl * ratio)
    pool = [(seg(), pre_len) for _ in range(num_prefix_prompts)]
    reqs: list[SimRequest] = []
    for i in range(requests):
        pre = rng.choice(pool)
        mean = isl * (1 - ratio)
        suf_len = max(1, int(rng.gauss(mean, mean / 4)))
        out = max(1, int(rng.gauss(osl, osl / 4)))
        follows = i - concurrency if i >= concurrency else None
        reqs.append(SimRequest(pre_len + suf_len, out, kb.keys([pre, (seg(), suf_len)]), 0.0, follows=follows,
                               app=f"prefix-{pool.index(pre)}", cache_prefix_blocks=pre_len // block_tokens))
    return Workload("prefix-ratio", block_tokens, reqs, [
        f"Dynamo prefix_ratio: ISL {isl}, OSL {osl}, ratio {ratio}, {num_prefix_prompts} prefixes, "
        f"{requests} requests, concurrency {concurrency} (closed loop)"])


def chat(block_tokens: int, *, users: int = 400, turns: int = 8, system_len: int = 1500, num_apps: int = 4,
         question_len: int = 150, answer_len: int = 250, think_s: float = 8.0, session_rate: float = 4.0,
         seed: int = 0) -> Workload:
    """Multi-turn chat: sessions arrive Poisson; turn k+1 is sent ``think`` (exp) after turn k completes and
    re-sends system + all earlier turns (answers included) + a new question."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    systems = [(seg(), system_len) for _ in range(num_apps)]
    reqs: list[SimRequest] = []
    for u, start in enumerate(_poisson(rng, session_rate, users)):
        app = u % num_apps
        segs = [systems[app]]
        prev = None
        for _ in range(turns):
            segs = [*segs, (seg(), question_len)]
            prompt = sum(length for _, length in segs)
            idx = len(reqs)
            reqs.append(SimRequest(prompt, answer_len, kb.keys(segs), start if prev is None else 0.0, follows=prev,
                                   delay=rng.expovariate(1 / think_s), session=f"user-{u}", app=f"app-{app}",
                                   cache_prefix_blocks=(prompt - question_len) // block_tokens))
            segs = [*segs, (seg(), answer_len)]
            prev = idx
    return Workload("chat", block_tokens, reqs, [
        f"chat: {users} sessions (Poisson {session_rate:g}/s) x {turns} turns, {num_apps} system prompts of "
        f"{system_len}, question {question_len}, answer {answer_len}, think ~Exp({think_s:g} s)"])


def rag(block_tokens: int, *, requests: int = 3000, docs: int = 2000, chunk_len: int = 512, chunks_per_query: int = 4,
        system_len: int = 600, question_len: int = 80, output_len: int = 200, zipf: float = 1.1, rate: float = 10.0,
        seed: int = 0) -> Workload:
    """RAG: system prompt + k retrieved chunks (Zipf popularity, retrieval order) + question; Poisson."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    system = (seg(), system_len)
    chunks = [(seg(), chunk_len) for _ in range(docs)]
    weights = [1 / (r + 1) ** zipf for r in range(docs)]
    reqs = []
    for t in _poisson(rng, rate, requests):
        picked: list[int] = []
        while len(picked) < chunks_per_query:
            c = rng.choices(range(docs), weights)[0]
            if c not in picked:
                picked.append(c)
        segs = [system, *(chunks[c] for c in picked), (seg(), question_len)]
        prompt = system_len + chunk_len * chunks_per_query + question_len
        reqs.append(SimRequest(prompt, output_len, kb.keys(segs), t, app="rag",
                               cache_prefix_blocks=system_len // block_tokens))
    return Workload("rag", block_tokens, reqs, [
        f"rag: {requests} queries at {rate:g}/s, {docs} chunks of {chunk_len} (Zipf {zipf}), {chunks_per_query} "
        f"per query, system {system_len}"])


def agent(block_tokens: int, *, tasks: int = 300, steps: int = 12, tools_len: int = 6000, task_len: int = 400,
          tool_output_len: int = 600, action_len: int = 120, tool_s: float = 1.5, task_rate: float = 1.0,
          seed: int = 0) -> Workload:
    """Agent loops: a shared tools + system prompt, a task, then steps that append the model's action and
    the tool's output; each step is sent ``tool_s`` (exp) after the previous completes."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    tools = (seg(), tools_len)
    reqs: list[SimRequest] = []
    for a, start in enumerate(_poisson(rng, task_rate, tasks)):
        segs = [tools, (seg(), task_len)]
        prev = None
        for _ in range(steps):
            prompt = sum(length for _, length in segs)
            idx = len(reqs)
            reqs.append(SimRequest(prompt, action_len, kb.keys(segs), start if prev is None else 0.0, follows=prev,
                                   delay=rng.expovariate(1 / tool_s), session=f"task-{a}", app="agent",
                                   cache_prefix_blocks=tools_len // block_tokens))
            segs = [*segs, (seg(), action_len), (seg(), tool_output_len)]
            prev = idx
    return Workload("agent", block_tokens, reqs, [
        f"agent: {tasks} tasks (Poisson {task_rate:g}/s) x {steps} steps, tools+system {tools_len}, task {task_len}, "
        f"action {action_len}, tool output {tool_output_len}"])


def unique(block_tokens: int, *, requests: int = 5000, prompt_len: int = 200, output_len: int = 100,
           rate: float = 40.0, seed: int = 0) -> Workload:
    """Unique short batch prompts: nothing to reuse (the case where cache-aware routing should be skipped)."""
    rng = random.Random(seed)
    kb = SegmentKeys(block_tokens)
    seg = itertools.count(1).__next__
    reqs = [SimRequest(prompt_len, output_len, kb.keys([(seg(), prompt_len)]), t, app="batch")
            for t in _poisson(rng, rate, requests)]
    return Workload("unique", block_tokens, reqs, [f"unique: {requests} prompts of {prompt_len}, rate {rate:g}/s"])


GENERATORS: dict[str, Callable[..., Workload]] = {
    "gsp": gsp,
    "one-shared-prefix": one_shared_prefix,
    "llmd-ladder": llmd_shared_prefix,
    "prefix-repetition": prefix_repetition,
    "prefix-ratio": prefix_ratio,
    "chat": chat,
    "rag": rag,
    "agent": agent,
    "unique": unique,
}
