"""One simulated llama.cpp server: slots that each hold their last sequence, a host prompt cache of whole prompts.

The ``llamacpp`` preset's replica (``engine.simulate`` builds it for a preset with ``engine="llamacpp"``). It plays
the part ``sim/replica.py``'s vLLM-style replica plays for the event loop (``enqueue``/``plan``/``finish`` at step
boundaries, ``step``, ``version``) and for the router's scrape (``waiting``, ``admitted``, ``kv_usage``), but keeps
llama.cpp's state instead of KV blocks:

- ``cost.max_running`` slots (``--parallel``); a request waits FIFO for a free slot and takes the least recently
  used one; taking it updates the host prompt cache (``sim/prompt_cache.py``: save the slot's sequence, restore a
  better entry, trim) and the request reuses the common prefix of the slot's sequence and its prompt, token by token
  (``Live.tokens``; a request known only by its block keys gets ids from them, ``tokens_of_keys``), never its
  last token;
- one step is one batch: a token per decoding slot, then prefill chunks up to ``cost.chunk_tokens`` (``n_batch``),
  timed by the cost model; a request's first token comes with the step that ends its prefill (plus the preset's
  ``response_s``, which holds no slot) and it decodes ``output − 1`` more steps; the slot then holds its prompt and
  the tokens it generated but the last (``Live.answer_tokens`` where known: a conversation's next turn contains them);
- a batch takes its requests' mean ``Live.time_factor`` times the cost model's time (1 unless a calibration replays
  llama.cpp's run-to-run variation; with one slot, the one request's);
- with ``SharedCores``, the replicas of one host share its cores: while ``k`` replicas run a step, each runs at
  ``min(1, cores / (k + background))`` of its speed, and every running step's end moves when ``k`` changes (the event
  loop reschedules the steps ``SharedCores.take_moved`` returns).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvroute.sim.costmodel import CostModel
from kvroute.sim.prompt_cache import HostPromptCache, PromptCacheConfig, common_prefix
from kvroute.sim.replica import Live, Step

Tokens = tuple[int, ...]


@dataclass(slots=True)
class _Slot:
    held: Tokens = ()
    request: Live | None = None
    last_used: float = -1.0


@dataclass(slots=True)
class _Running:
    work_s: float  # seconds of the step left at full speed
    step: Step


@dataclass(slots=True)
class SharedCores:
    """A host's cores shared by the replicas running a step (processor sharing, ``background`` cores busy with
    other work)."""

    cores: float
    background: float = 0.0
    running: dict[int, _Running] = field(default_factory=dict)  # id(replica) -> its step
    owners: dict[int, LlamaCppReplica] = field(default_factory=dict)
    moved: dict[int, LlamaCppReplica] = field(default_factory=dict)
    at: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores > 0 or self.background < 0:
            raise ValueError("cores > 0 and background >= 0 required")

    def rate(self, running: int | None = None) -> float:
        """Share of its own speed each running replica gets."""
        k = len(self.running) if running is None else running
        return min(1.0, self.cores / max(1e-9, k + self.background))

    def _advance(self, now: float) -> None:
        rate = self.rate()
        for run in self.running.values():
            run.work_s = max(0.0, run.work_s - (now - self.at) * rate)
        self.at = now

    def _retime(self, now: float) -> None:
        rate = self.rate()
        for key, run in self.running.items():
            end = now + run.work_s / rate
            if end != run.step.end:
                run.step.end = end
                owner = self.owners[key]
                owner.version += 1
                self.moved[key] = owner

    def start(self, replica: LlamaCppReplica, step: Step, now: float) -> None:
        """``replica`` starts ``step`` (its ``end`` is its full-speed end; it is moved to the shared one)."""
        self._advance(now)
        self.running[id(replica)] = _Running(step.end - step.start, step)
        self.owners[id(replica)] = replica
        self._retime(now)

    def stop(self, replica: LlamaCppReplica, now: float) -> None:
        self._advance(now)
        self.running.pop(id(replica), None)
        self.moved.pop(id(replica), None)
        self._retime(now)

    def take_moved(self) -> list[LlamaCppReplica]:
        """The replicas whose running step's end moved since the last call (their ``version`` changed)."""
        out = list(self.moved.values())
        self.moved.clear()
        return out


def _generated(r: Live) -> Tokens:
    """The tokens a finished request leaves in its slot after its prompt: every generated token but the last,
    its known ids first (``Live.answer_tokens``), then ids no prompt contains."""
    n = max(0, r.output - 1)
    known = r.answer_tokens[:n]
    return known + tuple(-1 - r.idx * 4096 - i for i in range(len(known), n))


def tokens_of_keys(keys: list[int], block_tokens: int, prompt: int, idx: int) -> Tokens:
    """Token ids standing in for a prompt known only by its chained block keys: ``block_tokens`` ids per key (two
    prompts share a token prefix exactly where they share keys), then ids of this request alone up to ``prompt``."""
    tokens = tuple(key * block_tokens + i for key in keys for i in range(block_tokens))[:prompt]
    return tokens + tuple(-1 - idx * 1_000_003 - i for i in range(prompt - len(tokens)))


class LlamaCppReplica:
    """A llama.cpp server's slots, host prompt cache, FIFO queue and clock."""

    def __init__(self, name: str, cost: CostModel, cache: PromptCacheConfig, response_s: float = 0.0,
                 context_tokens: int = 8192, cores: SharedCores | None = None, block_tokens: int = 16) -> None:
        self.name = name
        self.block_tokens = block_tokens
        self.cost = cost
        self.cache: HostPromptCache[Tokens] = HostPromptCache(cache)
        self.response_s = response_s
        self.context_tokens = context_tokens
        self.cores = cores
        self.slots = [_Slot() for _ in range(cost.max_running)]
        self.waiting: deque[Live] = deque()
        self.admitted: OrderedDict[int, Live] = OrderedDict()
        self.step: Step | None = None
        self.version = 0
        self.busy_time = 0.0
        self.steps = 0
        self.preemptions = 0
        self.events: list[tuple[bool, int]] | None = None  # no KV events from llama.cpp
        self.scheduled: dict[int, int] | None = None

    # --- views ----------------------------------------------------------------------------------
    @property
    def evictions(self) -> int:
        return self.cache.evicted

    def kv_usage(self) -> float:
        """Share of the slots' context in use (what llama.cpp's ``kv_cache_usage_ratio`` reports)."""
        used = sum(len(s.request.tokens or ()) for s in self.slots if s.request is not None)
        return min(1.0, used / (self.context_tokens * len(self.slots)))

    def held_tokens(self, live: Live) -> int:
        """Tokens of ``live``'s prompt a slot or a cache entry holds (what it could reuse here), never the last."""
        tokens = live.tokens or ()
        best = max((common_prefix(s.held, tokens) for s in self.slots), default=0)
        return max(0, min(max(best, self.cache.holds(tokens)), live.prompt - 1))

    def block_state(self) -> tuple[int, int, int]:
        """(tokens held in slots, 0, tokens in the host cache): the replica's end state."""
        return (sum(len(s.held) for s in self.slots), 0, self.cache.used_tokens)

    def idle(self) -> bool:
        return self.step is None

    # --- stepping -------------------------------------------------------------------------------
    def enqueue(self, r: Live) -> None:
        """Queue ``r`` for a slot; a request without token ids gets them from its keys (``tokens_of_keys``)."""
        if r.tokens is None:
            r.tokens = tokens_of_keys(r.keys, self.block_tokens, r.prompt, r.idx)
        self.waiting.append(r)

    def interrupt(self, now: float) -> bool:
        """Steps are single batches here: nothing to cut short."""
        return False

    def _admit(self, now: float) -> None:
        free = sorted((s for s in self.slots if s.request is None), key=lambda s: s.last_used)
        for slot in free:
            if not self.waiting:
                return
            r = self.waiting.popleft()
            tokens = r.tokens or ()
            held = self.cache.take(slot.held, tokens) or ()
            hit = self.cache.reused(held, tokens)
            slot.held = tokens[:hit]
            slot.request = r
            r.target = r.prompt
            r.computed = hit
            if r.hit_tokens < 0:
                r.hit_tokens = hit
                r.admitted_at = now
            self.admitted[id(r)] = r

    def plan(self, now: float) -> Step | None:
        """Admit waiting requests to free slots and start the next batch at ``now``; None when idle."""
        self._admit(now)
        cost = self.cost
        decoders = [s.request for s in self.slots if s.request is not None and s.request.decoding]
        budget = cost.chunk_tokens - len(decoders)
        chunks: list[tuple[Live, int]] = []
        attn = 0.0
        for s in self.slots:
            r = s.request
            if r is None or r.decoding or budget <= 0:
                continue
            c = min(budget, r.target - r.computed)
            chunks.append((r, c))
            attn += cost.chunk_attention(r.computed, c)
            budget -= c
        if not chunks and not decoders:
            self.step = None
            return None
        context = sum(r.prompt + r.generated for r in decoders if r is not None)
        dur = cost.step_time(sum(c for _, c in chunks), attn, len(decoders), context)
        members = [r for r, _ in chunks] + decoders
        factor = sum(r.time_factor for r in members) / len(members)
        if factor != 1.0:
            dur *= factor
        step = Step(now, now + dur, chunks, len(decoders), 1, context)
        self.step = step
        self.version += 1
        self.steps += 1
        if self.cores is not None:
            self.cores.start(self, step, now)
        return step

    def finish(self, now: float) -> tuple[list[Live], list[Live]]:
        """Apply the finished batch: (requests that got their first token, requests completed)."""
        step = self.step
        assert step is not None
        self.step = None
        self.busy_time += step.end - step.start
        if self.cores is not None:
            self.cores.stop(self, now)
        first: list[Live] = []
        done: list[Live] = []
        for s in self.slots:
            r = s.request
            if r is not None and r.decoding:
                r.generated += 1
                if r.generated >= r.output:
                    done.append(r)
        for r, c in step.chunks:
            r.computed += c
            if r.computed >= r.target:
                r.first_token_at = now + self.response_s
                first.append(r)
                r.generated = 1
                r.decoding = True
                if r.generated >= r.output:
                    done.append(r)
        for s in self.slots:
            r = s.request
            if r is not None and r in done:
                r.done_at = now
                r.decoding = False
                s.held = (r.tokens or ()) + _generated(r)
                s.request = None
                s.last_used = now
                self.admitted.pop(id(r), None)
        return first, done
